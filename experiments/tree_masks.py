"""What masking a draft tree's own nodes by the grammar gives: the same JSON-schema requests decoded
with a draft tree (`--branches`) with the drafter's logits masked at every node (grammar.TreeGuide)
and unmasked (verification alone masks), two rounds in alternating order, one process. Reported per
run: tokens per step, mean accepted drafts, decode tokens per second; the outputs of both must be
equal (verification masks either way).

    python experiments/tree_masks.py [--proposer eagle] [--branches 3,2] [-k 3] [--batch-size 1] [--limit 8]
"""

from __future__ import annotations

import argparse
import json

from structured_serve import MAX_TOKENS, SCHEMAS, requests

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.core import grammar


def run(pair, reqs, args, masked: bool) -> tuple[dict, list]:
    params = [SamplingParams(max_new_tokens=MAX_TOKENS, json_schema=SCHEMAS[kind]) for kind, _ in reqs]
    branches = tuple(int(b) for b in args.branches.split(","))
    dec = SpecDecoder(
        pair, method="ragged", batch_size=args.batch_size, k=args.k, proposer=args.proposer, branches=branches
    )
    saved = grammar.TreeGuide.mask
    if not masked:
        grammar.TreeGuide.mask = lambda self, logits, head_ids=None: logits
    try:
        outs = dec.generate([m for _, m in reqs], params)
    finally:
        grammar.TreeGuide.mask = saved
    s = dec.stats.summary()
    keys = ("mean_tokens_per_step", "mean_accepted", "decode_tokens_per_s")
    return {key: round(s[key], 3) for key in keys}, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proposer", default="eagle")
    parser.add_argument("--branches", default="3,2")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--limit", type=int, default=8)
    args = parser.parse_args()
    pair = load_pair("default")
    reqs = requests()[:: max(1, len(requests()) // args.limit)][: args.limit]
    results, tokens = {"masked": [], "unmasked": []}, {}
    for r in range(2):
        for masked in (True, False) if r == 0 else (False, True):
            name = "masked" if masked else "unmasked"
            out, tokens[name] = run(pair, reqs, args, masked)
            results[name].append(out)
            print(r, name, out, flush=True)
    print(
        json.dumps({"options": vars(args), "results": results, "same_tokens": tokens["masked"] == tokens["unmasked"]})
    )


if __name__ == "__main__":
    main()
