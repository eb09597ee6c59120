"""Target forward times with transformers' SDPA attention over one slab of slots (every row over the
longest row's span) against batchspec's (attention.py) over the ragged layout's size classes
(slots.SlotCache): uniform rows, and rows of mixed lengths.

    python experiments/attention_cost.py [--pair default] [--dtype float32] [--widths 1,2,3,5,7] [--json OUT]

Prints one line per shape: ms per forward (median of --repeats) for each attention and width.

Feeds: docs/benchmarks.md, "Attention: packed grouped-query heads and per-row runs".
"""

from __future__ import annotations

import argparse
import json

from batchspec import load_pair
from batchspec.models import attention
from batchspec.policy.costmodel import time_rows

SHAPES = {  # name -> the rows' cached lengths
    "B=1, 300": [300],
    "B=8, 300": [300] * 8,
    "B=8, 1200": [1200] * 8,
    "B=16, 300": [300] * 16,
    "B=16, 1200": [1200] * 16,
    "B=16, 4 x 1500 + 12 x 200": [1500] * 4 + [200] * 12,
}


def forward_ms(model, lengths: list[int], q: int, impl: str, repeats: int) -> float:
    """Median ms of one forward of q tokens per row after `lengths` cached slots, as the ragged
    layout feeds it, with attention implementation `impl` (transformers' over one slab)."""
    model.config._attn_implementation = impl
    try:
        return 1e3 * time_rows(model, lengths, q, repeats, classes=impl == attention.NAME)
    finally:
        model.config._attn_implementation = attention.NAME


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--widths", default="1,2,3,5,7", help="query tokens per row to time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the times here")
    args = ap.parse_args()
    target = load_pair(args.pair, dtype=args.dtype).target
    widths = [int(w) for w in args.widths.split(",")]
    out = {}
    print(f"{'shape':<28} {'attention':<10} " + " ".join(f"q={q:<6}" for q in widths))
    for name, lengths in SHAPES.items():
        for impl in ("sdpa", attention.NAME):
            times = [forward_ms(target, lengths, q, impl, args.repeats) for q in widths]
            out.setdefault(name, {})[impl] = dict(zip(map(str, widths), times))
            print(f"{name:<28} {impl:<10} " + " ".join(f"{t:<8.1f}" for t in times), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
