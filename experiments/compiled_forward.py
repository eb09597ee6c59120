"""The default target's forward as transformers runs it, with lean layers, and compiled.

Each variant is timed forward by forward as the ragged layout feeds it (`costmodel.time_forward`:
B rows, q tokens each, over a span of S cached slots), in alternation, --repeats times; the median
of each. `compiled` is models/compiled.py's forward (lean layers, attention and the cache outside
the graph) under torch.compile's inductor.

    python experiments/compiled_forward.py [--shapes 1x1,1x4,8x1,16x1] [--span 300] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from batchspec import load_pair
from batchspec.models import compiled, lean
from batchspec.models.linears import tune_linears
from batchspec.policy.costmodel import time_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x1,1x4,8x1,16x1", help="BxQ pairs, comma-separated")
    parser.add_argument("--span", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15, help="forwards per timing (their median)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default="transformers,compiled,frozen")
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load_pair(pair="default", dtype=args.dtype, compile=False).target  # transformers' layers
    models, compile_s = {}, {}
    wanted = args.variants.split(",")
    if "transformers" in wanted:
        models["transformers"] = target
    if "lean" in wanted:
        models["lean"] = copy.deepcopy(target)
        lean.install(models["lean"])
        tune_linears(models["lean"])
    for name in ("compiled", "frozen", "autotuned"):
        if name not in wanted:
            continue
        model = copy.deepcopy(target)
        started = time.perf_counter()
        lean.install(model)
        tune_linears(model)
        compiled.install(model, freeze=name == "frozen", autotune=name == "autotuned")
        for shape in args.shapes.split(","):
            b, q = (int(v) for v in shape.split("x"))
            time_forward(model, b, q, args.span, repeats=1)
        compile_s[name] = round(time.perf_counter() - started, 1)
        print("compile seconds", compile_s, flush=True)
        models[name] = model
    rows = []
    for shape in args.shapes.split(","):
        b, q = (int(v) for v in shape.split("x"))
        ms: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                ms[name].append(1e3 * time_forward(model, b, q, args.span, repeats=args.calls))
        row = {"rows": b, "q": q, "span": args.span, "dtype": args.dtype}
        row |= {f"{name}_ms": round(statistics.median(v), 2) for name, v in ms.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "compile_s": compile_s}
            json.dump(info | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
