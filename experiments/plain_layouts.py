"""Plain decoding (`ar`) in its two layouts, in one process: the ragged layout's continuous
batching (what `ar` runs) beside static padded batches (`runners.static.run_static`, what it ran
until 2026-12-07: B prompts at a time, sorted by length, prefilled in length buckets), on the same
Spec-Bench prompts, alternating (which goes first alternates by round); tok/s per run, the median
ratio ragged / static, and whether both gave the same tokens.

    python experiments/plain_layouts.py PROMPTS.jsonl [--batch-sizes 1,8,16] [--n 16]
        [--max-new-tokens 64] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.runners import ragged, static
from batchspec.tools.prompts import read_prompts

LAYOUTS = {
    "ragged": ragged.run,  # the method table imports `ar`'s runner by name at each run: patched in main
    "static": lambda ctx, seqs, config: static.run_static(ctx, seqs, config.batch_size),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts")
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = [p.text for p in read_prompts(args.prompts, limit=args.n, every=max(1, 480 // args.n))]
    pair = load_pair(pair="default", dtype="float32")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    layout = {"run": LAYOUTS["ragged"]}
    ragged.run = lambda ctx, seqs, config: layout["run"](ctx, seqs, config)
    rows = []
    for b in (int(v) for v in args.batch_sizes.split(",")):
        dec = SpecDecoder(pair, method="ar", batch_size=b)
        dec.prepare()
        speed: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            for name in list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS)[::-1]:
                layout["run"] = LAYOUTS[name]
                outs = dec.generate(prompts, params)
                speed[name].append(dec.stats.summary()["tokens_per_s"])
                tokens.setdefault(name, [o.token_ids for o in outs])
        ratios = [g / s for g, s in zip(speed["ragged"], speed["static"])]
        row = {
            "batch_size": b,
            "tok_s": speed,
            "ratio_median": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "same_tokens": sum(x == y for x, y in zip(tokens["ragged"], tokens["static"])),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
