"""How often can EXSPEC run a same-length group? A model-free simulation of its scheduler.

Prompt lengths come from Spec-Bench tokenised with the default pair's chat template; each step a
row grows by (accepted + 1) tokens, accepted drawn from an acceptance histogram (by default the
one measured for the default pair with n-gram lookup at k = 4, see docs/benchmarks.md); rows stop
after --max-new-tokens. We report the group rate (decode steps run as one same-length group / all
decode steps) and the mean batch occupancy for several scheduler policies. The engine computes the
same group rate in its stats (`group_rate`), so a real run can confirm any row of this table.

    python experiments/group_rate.py --prompts ../shared/data/spec_bench/question.jsonl

Feeds: docs/benchmarks.md, "EXSPEC scheduling policies".
"""

from __future__ import annotations

import argparse
import random
import statistics

from batchspec.runners.scheduler import Scheduler
from batchspec.tools.prompts import read_prompts


def simulate(lengths, batch, window, min_group, hist, max_new, seed) -> tuple[float, float]:
    rng = random.Random(seed)
    sched = Scheduler(lengths, batch, window, min_group)
    current = dict(enumerate(lengths))
    made = dict.fromkeys(current, 0)
    counts = list(hist)
    decode = grouped = rows = 0
    while not sched.done():
        d = sched.next()
        done = set()
        if d.kind != "prefill":
            decode += 1
            rows += len(d.ids)
            grouped += len({current[i] for i in d.ids}) == 1
        for i in d.ids:
            grow = 1 if d.kind == "prefill" else rng.choices(range(len(counts)), weights=counts)[0] + 1
            grow = min(grow, max_new - made[i])
            current[i] += grow
            made[i] += grow
            if made[i] >= max_new:
                done.add(i)
        sched.ran(d.ids, current, done)
    return grouped / decode, rows / decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--limit", type=int, default=480)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--hist", default="996,77,40,31,89", help="accepted-count weights for 0..k (default: measured, n-gram k=4)"
    )
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    from batchspec.models.pair import load_pair  # only the tokenizer is needed, but it lives in the GGUF

    tokenizer_pair = load_pair("default")
    lengths = [len(tokenizer_pair.encode(p.text)) for p in read_prompts(args.prompts, args.limit)]
    hist = [float(x) for x in args.hist.split(",")]
    b = args.batch_size
    policies = [
        ("paper: window 4B, groups of B", 4 * b, b),
        ("groups of B/2", 4 * b, max(1, b // 2)),
        ("groups of 2", 4 * b, 2),
        ("window 16B, groups of B", 16 * b, b),
        ("window 16B, groups of B/2", 16 * b, max(1, b // 2)),
    ]
    print(f"{len(lengths)} prompts, batch {b}, {args.max_new_tokens} new tokens, accepted weights {hist}")
    for name, window, min_group in policies:
        rates, occ = zip(
            *(simulate(lengths, b, window, min_group, hist, args.max_new_tokens, s) for s in range(args.seeds))
        )
        print(f"{name:<30} group rate {statistics.mean(rates):6.1%}   mean occupancy {statistics.mean(occ):5.2f} rows")


if __name__ == "__main__":
    main()
