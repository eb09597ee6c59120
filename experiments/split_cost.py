"""Is a step cheaper as one padded verify batch or split into a plain sub-batch and a verify one?

For a batch of B rows of which a share drafts k tokens and the rest drafts none, one rectangular
forward costs t(B, k + 1); the split costs t(B_plain, 1) + t(B_spec, k + 1). Both are timed on
the target of a pair, over a cache span S, with `costmodel.time_forward` (median of repeats).

    python experiments/split_cost.py [--pair default] [--dtype float32] [--span 512] [-k 4]

Feeds: docs/benchmarks.md, "Adaptive speculation: `-k auto`".
"""

from __future__ import annotations

import argparse

import torch

from batchspec.models.pair import load_pair
from batchspec.policy.costmodel import time_forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--span", type=int, default=512)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    target = load_pair(pair=args.pair, dtype=args.dtype).target
    q, t = args.k + 1, lambda b, q: time_forward(target, b, q, args.span, args.repeats) if b else 0.0
    print(f"target forward ms, span {args.span}, k {args.k}; 'split' = plain sub-batch + verify sub-batch")
    print(f"{'B':>3} {'drafting':>9} {'one batch':>10} {'split':>8} {'plain only':>11}")
    with torch.inference_mode():
        for batch in (4, 8, 16):
            whole, plain = t(batch, q), t(batch, 1)
            for spec in (batch // 4, batch // 2, 3 * batch // 4):
                split = t(batch - spec, 1) + t(spec, q)
                print(f"{batch:>3} {spec:>9} {1e3 * whole:>10.1f} {1e3 * split:>8.1f} {1e3 * plain:>11.1f}")


if __name__ == "__main__":
    main()
