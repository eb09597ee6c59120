"""Tokens per step of each proposer of the default pair on Spec-Bench, per category, side by side.

Greedy `spec1` at a fixed k over the first N prompts of every category (13 categories), float32;
for each proposer: mean tokens per verify step (accepted drafts + the target's token) per category
and overall, and exactness against `reference` on the first prompt of each category. Also the cost
of one proposer forward against one target forward at batch 1 (one token over 300 cached).

    python experiments/proposer_acceptance.py --prompts ../shared/data/spec_bench/question.jsonl \\
        [--proposers ngram,draft,eagle,eagle/3] [--k 4] [--per-category 5] [--max-new-tokens 64] [--json OUT] \\
        [--head WEIGHTS.safetensors]   # another head than the shipped one (scripts/train_eagle.py --out)

A proposer written NAME/C verifies a draft tree of C candidates per position (`--branches C`),
NAME/C1xC2x.. one of C_d nodes at depth d (`--branches C1xC2x..`).

Feeds: docs/benchmarks.md, "The draft head that reads the target's features"; README.md.
"""

from __future__ import annotations

import argparse
import json
import time

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.cli import branches_value
from batchspec.models.eagle import load_head
from batchspec.models.linears import tune_linears
from batchspec.tools.costs import forward_seconds
from batchspec.tools.prompts import by_category


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--proposers", default="ngram,draft,eagle")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    ap.add_argument("--head", default=None, help="draft head weights (default: the shipped head)")
    args = ap.parse_args()
    pair = load_pair("default", dtype=args.dtype)
    if args.head:
        pair.head = load_head(pair.target, pair.target.dtype, path=args.head)
        tune_linears(pair.head)  # as load_pair does
    cats = by_category(args.prompts, args.per_category)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    firsts = [p[0] for p in cats.values()]
    ref = [o.token_ids for o in SpecDecoder(pair, method="reference").generate(firsts, params)]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    result = {"command": f"python experiments/proposer_acceptance.py {flags}", "proposers": {}}
    target_s = forward_seconds(pair.target, 1, 1, 300, 25)
    for name in args.proposers.split(","):
        proposer, _, branches = name.partition("/")
        dec = SpecDecoder(pair, method="spec1", k=args.k, proposer=proposer, branches=branches_value(branches or "1"))
        per_cat, tokens, steps, start = {}, 0, 0, time.time()
        for cat, prompts in cats.items():
            outs = dec.generate(prompts, params)
            n_tok = sum(len(o.accepted_per_step) + sum(o.accepted_per_step) for o in outs)
            n_steps = sum(len(o.accepted_per_step) for o in outs)
            per_cat[cat] = round(n_tok / max(n_steps, 1), 3)
            tokens, steps = tokens + n_tok, steps + n_steps
        exact = [o.token_ids for o in dec.generate(firsts, params)] == ref
        model = dec.proposer.model
        cost = None if model is None else round(forward_seconds(model, 1, 1, 300, 25) / target_s, 4)
        result["proposers"][name] = {
            "tokens_per_step": round(tokens / max(steps, 1), 3),
            "per_category": per_cat,
            "exact_vs_reference": exact,
            "forward_cost_vs_target": cost,
            "seconds": round(time.time() - start, 1),
        }
        print(json.dumps({name: result["proposers"][name]}), flush=True)
    names = list(result["proposers"])
    print("\n| category | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for cat in cats:
        print(f"| {cat} | " + " | ".join(f"{result['proposers'][n]['per_category'][cat]:.2f}" for n in names) + " |")
    print("| **overall** | " + " | ".join(f"**{result['proposers'][n]['tokens_per_step']:.2f}**" for n in names) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
