"""Every step of `ragged -k auto` timed against what its cost model predicted just before, and
`ar` on the same prompts in the same process: where auto's choices gain or lose.

    python experiments/auto_steps.py --prompts ../shared/data/spec_bench/question.jsonl --every 15 \\
        --limit 32 [--pair default] [--dtype bfloat16] [--proposer ngram] [--batch-size 8] \\
        [--max-new-tokens 64] [--rounds 2] [--json OUT]

Each round runs `ar`, then `ragged -k auto` (the decoders persist: round 2 runs with what auto
learned in round 1). Steps are grouped by kind (plain or verify) and batch (all rows running, or
fewer: the end of the workload); per group: steps, tokens, ms per step, timed / predicted
seconds (the model's prediction of the chosen width) and tokens per second.

Feeds: docs/benchmarks.md, "Current numbers: `-k auto` on a cost model that does not extrapolate".
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.tools.prompts import read_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--proposer", default="ngram")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompts", default=None, help="a prompt file (default: a few built-in prompts)")
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pair = load_pair(args.pair, dtype=args.dtype)
    prompts = (
        [p.text for p in read_prompts(args.prompts, args.limit, args.every)]
        if args.prompts
        else ["Why is the sky blue?", "Write a haiku about the sea.", "List three prime numbers.", "Hello!"]
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ar = SpecDecoder(pair, method="ar", batch_size=args.batch_size)
    auto = SpecDecoder(pair, method="ragged", batch_size=args.batch_size, k="auto", proposer=args.proposer)
    steps = record(auto, args.batch_size)
    rounds = []
    for r in range(args.rounds):
        steps.clear()
        ar.generate(prompts, params)
        auto.generate(prompts, params)
        rates = {name: d.stats.summary()["tokens_per_s"] for name, d in (("ar", ar), ("auto", auto))}
        groups = summarise(steps)
        rounds.append({"round": r + 1, "tokens_per_s": rates, "groups": groups})
        print(f"round {r + 1}: ar {rates['ar']:.1f} tok/s, ragged -k auto {rates['auto']:.1f} tok/s")
        for g in groups:
            print(
                f"  {g['kind']:<6} {g['batch']:<10} steps {g['steps']:>4}  tokens {g['tokens']:>5}  "
                f"{g['ms_per_step']:7.1f} ms/step  timed/predicted {g['timed_vs_predicted']:.2f}  "
                f"{g['tokens_per_s']:6.1f} tok/s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)


def record(decoder: SpecDecoder, batch_size: int) -> list[dict]:
    """Wrap the decoder's policy so that each step's outcome and the model's prediction of its
    width (made before the step's own timing is learned) are kept."""
    policy, steps = decoder._speculation(), []
    observe = policy.observe

    def observed(seqs, proposal, width, num_accepted, prop_s, step_s, span, carried=False):
        rows = len(num_accepted)
        steps.append(
            {
                "kind": "verify" if width else "plain",
                "batch": "all rows" if rows == batch_size else "fewer rows",
                "tokens": rows + sum(num_accepted),
                "seconds": prop_s + step_s,
                "step_s": step_s,
                "predicted_s": policy.step_cost(rows, width + 1, span),
            }
        )
        observe(seqs, proposal, width, num_accepted, prop_s, step_s, span, carried)

    policy.observe = observed
    return steps


def summarise(steps: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for s in steps:
        groups[s["kind"], s["batch"]].append(s)
    out = []
    for (kind, batch), ss in sorted(groups.items()):
        seconds = sum(s["seconds"] for s in ss)
        out.append(
            {
                "kind": kind,
                "batch": batch,
                "steps": len(ss),
                "tokens": sum(s["tokens"] for s in ss),
                "ms_per_step": 1e3 * seconds / len(ss),
                "timed_vs_predicted": sum(s["step_s"] for s in ss) / max(sum(s["predicted_s"] for s in ss), 1e-9),
                "tokens_per_s": sum(s["tokens"] for s in ss) / max(seconds, 1e-9),
            }
        )
    return out


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t:.0f} s")
