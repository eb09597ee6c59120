"""What constraining costs a decode step, offline: the same 16 prompts with a JSON schema and free, in
one ragged batch of B (the defaults), two rounds in alternating order. Reported per run: decode
tokens per second (prefill excluded: constrained answers are shorter, so whole-run throughput
would count their prefill more), tokens per step, and the share of time in the stages where masks
are computed (draft: cutting drafts and jump-forward; accept: the masks of the verified columns).

    python experiments/structured_cost.py [--batch-sizes 1,8] [--json docs/bench/structured_cost.json]
"""

from __future__ import annotations

import argparse
import json

from structured_serve import MAX_TOKENS, SCHEMAS, requests

from batchspec import SamplingParams, SpecDecoder, load_pair

KEYS = ("tokens", "decode_tokens_per_s", "mean_tokens_per_step", "forced_tokens")


def run(pair, reqs, batch: int, constrained: bool) -> dict:
    params = [
        SamplingParams(max_new_tokens=MAX_TOKENS, **({"json_schema": SCHEMAS[kind]} if constrained else {}))
        for kind, _ in reqs
    ]
    dec = SpecDecoder(pair, method="ragged", batch_size=batch)
    dec.generate([m for _, m in reqs], params)
    s = dec.stats.summary()
    out = {key: round(s[key], 3) if isinstance(s[key], float) else s[key] for key in KEYS}
    out["draft_share"] = round(s["time_share"].get("draft", 0.0), 4)
    out["accept_share"] = round(s["time_share"].get("accept", 0.0), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    pair = load_pair("default")
    reqs = requests()[::2]  # 16: four of each schema
    results = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rows = results[f"B{batch}"] = {"schema": [], "free": []}
        for constrained in (True, False, False, True):
            rows["schema" if constrained else "free"].append(run(pair, reqs, batch, constrained))
            print(batch, rows, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": MAX_TOKENS, **results}, f, indent=1)


if __name__ == "__main__":
    main()
