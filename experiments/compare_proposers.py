"""Which proposer and k for the default pair? `spec1` against `ar` at batch 1, on the same
Spec-Bench prompts (every 37th: 13 prompts across the categories), in one process, float32 and
bfloat16. Prints one JSON line per run; the README's "The default pair" table comes from it.

    python experiments/compare_proposers.py [--prompts ../shared/data/spec_bench/question.jsonl] [--json OUT]

Feeds: README.md, "The default pair: a draft head, n-gram lookup, a distilled draft".
"""

from __future__ import annotations

import argparse
import json

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.tools.prompts import read_prompts

RUNS = [
    ("ar", None, 1),
    ("spec1", "draft", 2),
    ("spec1", "draft", 4),
    ("spec1", "ngram", 2),
    ("spec1", "ngram", 4),
    ("spec1", "ngram", 6),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = [p.text for p in read_prompts(args.prompts, 13, 37)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for dtype in ("float32", "bfloat16"):
        pair = load_pair("default", dtype=dtype)
        SpecDecoder(pair, method="ar").generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
        for method, proposer, k in RUNS:
            dec = SpecDecoder(pair, method=method, batch_size=1, k=k, proposer=proposer)
            dec.generate(prompts, params)
            s = dec.stats.summary()
            row = dict(
                dtype=dtype,
                method=method,
                proposer=proposer,
                k=k,
                decode_tokens_per_s=s["decode_tokens_per_s"],
                mean_accepted=s["mean_accepted"],
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
