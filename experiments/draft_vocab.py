"""A self-draft's reduced vocabulary (`--draft-vocab N`) side by side: `ar`, then `ragged` with the
target's int8 copy at each head size, alternating in every repeat (paired ratios to that repeat's
`ar`), on Spec-Bench prompts: the long ones (over 3,000 characters, past a 512-token window) and
short ones, half each.

    python experiments/draft_vocab.py --target G.gguf --vocabs full,32768,16384 --batch-sizes 1,4 \
        --k 3,auto --repeats 2 --json out.json
    python experiments/draft_vocab.py --pair default --vocabs full,16384,8192
    python experiments/draft_vocab.py --target G.gguf --vocabs 32768 --kv-copy off,on

`--kv-copy off,on`: each ragged decoder also with its draft's cache fed the prompt (off) instead of
starting from the target's entries (on, the default for a self-draft).

Each row: tokens/s (whole run, prefill included), decode tokens/s, tokens per step, the head's
rows at the end, and the ratio to `ar` per repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from batchspec import SamplingParams, SpecDecoder, load_pair

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench", "question.jsonl")


def prompts(n: int) -> list[str]:
    with open(PROMPTS, encoding="utf-8") as f:
        texts = [json.loads(line)["turns"][0] for line in f]
    long = [t for t in texts if len(t) > 3000][::12][: n // 2]
    short = [t for t in texts if len(t) < 400][::40][: n - len(long)]
    return long + short


def run(dec: SpecDecoder, texts: list[str], params: SamplingParams) -> dict:
    dec.generate(texts, params)
    s = dec.stats.summary()
    keys = ("tokens_per_s", "decode_tokens_per_s", "mean_tokens_per_step")
    return {k: round(s[k], 2) for k in keys} | {"time_share": {k: round(v, 3) for k, v in s["time_share"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair")
    ap.add_argument("--target")
    ap.add_argument("--vocabs", default="full,32768,16384")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--k", default="3,auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-copy", default="on")
    ap.add_argument("--json")
    args = ap.parse_args()
    texts, params = prompts(args.prompts), SamplingParams(max_new_tokens=args.max_new_tokens)
    vocabs = [None if v == "full" else int(v) for v in args.vocabs.split(",")]
    pairs = {v: load_pair(pair=args.pair, target=args.target, draft="self", draft_vocab=v) for v in vocabs}
    ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
    results = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        decs = {("ar", None, None, None): SpecDecoder(pairs[vocabs[0]], method="ar", batch_size=b)}
        for v in vocabs:
            for k in ks:
                for copy in args.kv_copy.split(","):
                    dec = SpecDecoder(pairs[v], method="ragged", proposer="draft", k=k, batch_size=b)
                    dec.proposer.kv_from_target = copy == "on"
                    decs[("ragged", v, k, copy)] = dec
        for dec in decs.values():  # warm: the policy's measurements, the heads' first tokens
            dec.generate(texts[:2], SamplingParams(max_new_tokens=8))
        rows = {key: [] for key in decs}
        for rep in range(args.repeats):
            for key, dec in decs.items():
                rows[key].append(run(dec, texts, params))
                ar = rows[("ar", None, None, None)][rep]["tokens_per_s"]
                got = rows[key][-1]
                print(
                    f"B={b} rep {rep} {key}: {got['tokens_per_s']} tok/s ({got['tokens_per_s'] / ar:.2f}x ar), "
                    f"decode {got['decode_tokens_per_s']}, {got['mean_tokens_per_step']} per step",
                    flush=True,
                )
        for (method, v, k, copy), runs in rows.items():
            ratios = [r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(runs, rows[("ar", None, None, None)])]
            head = pairs[v].draft.get_output_embeddings() if v is not None else None
            results.append(
                {
                    "batch_size": b,
                    "method": method,
                    "draft_vocab": v,
                    "k": k,
                    "kv_copy": copy,
                    "runs": runs,
                    "vs_ar": [round(x, 3) for x in ratios],
                    "vs_ar_median": round(statistics.median(ratios), 3),
                    "head_rows": None if head is None else head.n,
                }
            )
    for r in results:
        print(
            f"B={r['batch_size']} {r['method']:6s} vocab={r['draft_vocab']} k={r['k']} copy={r['kv_copy']}: "
            f"{r['vs_ar_median']}x ar "
            f"{r['vs_ar']}, head rows {r['head_rows']}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
