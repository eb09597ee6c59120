"""A self-draft's forward with lean layers (models/lean.py) beside transformers' layers.

Two int8 self-drafts of the built-in pair's target (full LM heads), one with `lean.install`, one without, timed
forward by forward as the ragged layout feeds them (`costmodel.time_forward`: B rows, q tokens
each, over a span of S cached slots), in alternation, --repeats times; the median of each.

    python experiments/lean_layers.py [--shapes 1x1,1x2,4x1] [--span 400] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

import torch

from batchspec import load_pair
from batchspec.models import lean, quant
from batchspec.policy.costmodel import time_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x1,1x2,4x1", help="BxQ pairs, comma-separated")
    parser.add_argument("--span", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15, help="forwards per timing (their median)")
    parser.add_argument("--dtype", default="bfloat16", help="the drafts' compute dtype")
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load_pair(pair="default", dtype="float32").target
    dtype = getattr(torch, args.dtype)
    drafts = {"lean": quant.self_draft(target, "int8", dtype)}
    with mock.patch.object(lean, "install", lambda model: 0):
        drafts["transformers"] = quant.self_draft(target, "int8", dtype)
    rows = []
    for shape in args.shapes.split(","):
        b, q = (int(v) for v in shape.split("x"))
        ms: dict[str, list[float]] = {name: [] for name in drafts}
        for _ in range(args.repeats):
            for name, model in drafts.items():
                ms[name].append(1e3 * time_forward(model, b, q, args.span, repeats=args.calls))
        row = {"rows": b, "q": q, "span": args.span, "dtype": str(dtype).removeprefix("torch.")}
        row |= {f"{name}_ms": round(statistics.median(v), 2) for name, v in ms.items()}
        row["ratio"] = round(row["lean_ms"] / row["transformers_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
