"""Decoding with each compiled forward's attention planned once (attention.Planned) beside the
same decoder calling the attention function layer by layer, in one process: `ar` and the defaults
(`ragged`, `-k auto`) at each batch size, on the same Spec-Bench prompts, alternating (which goes
first alternates by round); tok/s per run, the median ratio planned / per layer, and whether both
gave the same tokens.

    python experiments/planned_step.py PROMPTS.jsonl [--draft self] [--batch-sizes 1,4] [--n 8]
        [--max-new-tokens 48] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.models import attention
from batchspec.tools.prompts import read_prompts

VARIANTS = {"planned": attention.plan, "per layer": lambda *args: None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts")
    parser.add_argument("--draft", help="the pair's draft (e.g. self); default: the built-in pair's")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--methods", default="ar,ragged")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = [p.text for p in read_prompts(args.prompts, limit=args.n, every=max(1, 480 // args.n))]
    pair = load_pair(pair="default", dtype="float32", draft=args.draft)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for b in (int(v) for v in args.batch_sizes.split(",")):
        for method in args.methods.split(","):
            dec = SpecDecoder(pair, method=method, batch_size=b)
            dec.prepare()
            speed: dict[str, list[float]] = {name: [] for name in VARIANTS}
            tokens: dict[str, list] = {}
            for r in range(args.rounds):
                for name in list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]:
                    attention.plan = VARIANTS[name]
                    outs = dec.generate(prompts, params)
                    speed[name].append(dec.stats.summary()["tokens_per_s"])
                    tokens.setdefault(name, [o.token_ids for o in outs])
            attention.plan = VARIANTS["planned"]
            ratios = [p / g for p, g in zip(speed["planned"], speed["per layer"])]
            row = {
                "batch_size": b,
                "method": method,
                "tok_s": speed,
                "ratio_median": round(statistics.median(ratios), 3),
            }
            row["same_tokens"] = sum(x == y for x, y in zip(tokens["planned"], tokens["per layer"]))
            row["mean_tokens_per_step"] = dec.stats.summary()["mean_tokens_per_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args)}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(info | {"startup": pair.startup, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
