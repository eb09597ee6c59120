"""What the batch-invariant mode costs per target forward, and where: forwards of q tokens per row
as the ragged layout feeds them (costmodel.time_rows), plain kernels against the mode, then a
torch.profiler table of the mode's top operators for one shape.

    python experiments/invariant_cost.py [--pair default] [--dtype bfloat16] [--shapes 1x300x1,16x300x1]
        [--profile 16x300x1] [--repeats 5] [--json OUT]

A shape is BxSPANxQ: B rows, SPAN cached slots each, Q query tokens per row.

Feeds: docs/benchmarks.md, "The batch-invariant mode".
"""

from __future__ import annotations

import argparse
import json

import torch

from batchspec import load_pair
from batchspec.models import invariant
from batchspec.policy.costmodel import time_rows


def parse(shape: str) -> tuple[int, int, int]:
    b, span, q = (int(x) for x in shape.split("x"))
    return b, span, q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default="1x300x1,4x300x1,16x300x1,1x300x4,16x300x4")
    ap.add_argument("--profile", default="16x300x1", help="a shape to profile under the mode ('' for none)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    target = load_pair(args.pair, dtype=args.dtype).target
    rows = []
    for shape in args.shapes.split(","):
        b, span, q = parse(shape)
        invariant.uninstall(target)
        plain = time_rows(target, [span] * b, q, args.repeats)
        invariant.install(target)
        mode = time_rows(target, [span] * b, q, args.repeats)
        rows.append({"shape": shape, "plain_ms": round(1e3 * plain, 2), "mode_ms": round(1e3 * mode, 2)})
        print(f"{shape:>12}: plain {1e3 * plain:7.2f} ms  mode {1e3 * mode:7.2f} ms  mode/plain {mode / plain:.2f}")
    table = None
    if args.profile:
        b, span, q = parse(args.profile)
        invariant.install(target)
        with torch.profiler.profile() as prof:
            time_rows(target, [span] * b, q, 3)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pair": args.pair, "dtype": args.dtype, "forwards": rows, "profile": table}, f, indent=1)


if __name__ == "__main__":
    main()
