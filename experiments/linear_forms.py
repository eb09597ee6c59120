"""Target forward times with every linear layer as `F.linear` against the formulation linears.py
measures per row count (`(W @ x^T)^T` or oneDNN's where faster), side by side in rounds.

    python experiments/linear_forms.py [--pair default] [--dtype float32] [--batch-sizes 1,4,8,16] \\
        [--widths 1,2,3,5] [--span 300] [--rounds 3] [--json OUT]

Prints one line per (B, q): ms per forward (the best of --rounds, the two arms alternating), the
ratio, and the form the table picked for that row count M = B x q.

    python experiments/linear_forms.py --sweep 1,2,5,8,20,40,128 [--dtype float32] [--json OUT]

instead times the linear layers alone: one sweep over all the target's weights (as a forward
streams them) per formulation and row count M, ms.

Feeds: docs/benchmarks.md, "oneDNN's matmul over packed weights".
"""

from __future__ import annotations

import argparse
import json

from batchspec import load_pair
from batchspec.models.linears import FORMS, LARGE, TUNE_MAX, TunedLinear, bucket
from batchspec.policy.costmodel import time_forward


def table_of(model):
    layers = [m for m in model.modules() if isinstance(m, TunedLinear)]
    if not layers:
        raise SystemExit("the model has no tuned linear layers (not on a CPU?)")
    return layers[0].table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--widths", default="1,2,3,5")
    ap.add_argument("--span", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", default=None, help="row counts: time the linear layers alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = load_pair(args.pair, dtype=args.dtype).target
    table = table_of(model)
    rows = sweep(table, [int(m) for m in args.sweep.split(",")]) if args.sweep else forwards(model, table, args)
    if args.json:
        flags = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"args": flags, "rows": rows}, f, indent=1)


def sweep(table, counts: list[int]) -> list[dict]:
    rows = []
    for m in counts:
        ms = {name: round(1e3 * s, 2) for name, s in table.time_forms(m, FORMS).items()}
        rows.append({"M": m} | {f"{name}_ms": t for name, t in ms.items()})
        print(f"M={m:<4} " + "  ".join(f"{name} {t:7.1f} ms" for name, t in ms.items()), flush=True)
    return rows


def forwards(model, table, args) -> list[dict]:
    shapes = [(int(b), int(q)) for b in args.batch_sizes.split(",") for q in args.widths.split(",")]
    for b, q in shapes:  # measure the choices first (and warm every shape)
        time_forward(model, b, q, args.span)
    tuned = dict(table.choice)
    plain = {m: "plain" for m in [*range(1, TUNE_MAX + 1), LARGE]}
    best: dict = {}
    for _ in range(args.rounds):
        for b, q in shapes:
            for arm, choice in (("F.linear", plain), ("tuned", tuned)):
                table.choice = choice
                ms = 1e3 * time_forward(model, b, q, args.span)
                key = (b, q, arm)
                best[key] = min(best.get(key, ms), ms)
    table.choice = tuned
    rows = []
    for b, q in shapes:
        a, t = best[(b, q, "F.linear")], best[(b, q, "tuned")]
        form = tuned.get(bucket(b * q), "plain")
        rows.append({"B": b, "q": q, "F.linear_ms": round(a, 2), "tuned_ms": round(t, 2), "form": form})
        print(f"B={b:<3} q={q}  F.linear {a:7.1f} ms  tuned {t:7.1f} ms  ({a / t:4.2f}x, {form})", flush=True)
    return rows


if __name__ == "__main__":
    main()
