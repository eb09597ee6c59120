"""Which draft tree for a budget of verified columns: tokens per step of sub-trees of a beam, offline.

Runs greedy `spec1` with a beam of C nodes per depth over k depths, keeping every step's tree. The
target's greedy continuation of a row is the row's own output (the decoding is exact), so what a
step would have yielded with a smaller tree is known without running it: the tree's longest root
path that spells the continuation, plus the target's token. A sub-tree keeps the first (best) C_d
nodes at depth d whose parents it keeps (`--branches C1xC2x..` draws its own beam, re-ranking the
children of fewer parents, so this is an estimate of that shape). Prints, for each count of
verified columns (1 + nodes), the best widths (non-increasing) and their tokens per step; the
full beam's line equals what the decoder itself measured (checked here).

    python experiments/tree_shapes.py --prompts ../shared/data/spec_bench/question.jsonl \\
        [--proposer ngram+eagle] [--branches 4] [-k 5] [--per-category 2] [--json OUT]

Feeds: docs/benchmarks.md, "Widths per depth: `--branches 3x2x1`"; README.md, "Draft trees".
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.tools.prompts import by_category


def record_trees(decoder: SpecDecoder) -> list:
    """Wrap the decoder's proposer: every tree it drafts, per row (sequence, its length, the row's
    step number, parents, node tokens), in step order."""
    steps, propose, seen = [], decoder.proposer.propose, {}

    def recording(batch, k, params, noise, stop=None):
        proposal = propose(batch, k, params, noise, stop)
        for b, seq in enumerate(batch.seqs):
            number = seen[id(seq)] = seen.get(id(seq), -1) + 1
            row = (proposal.tree.parent[b].tolist(), proposal.nodes[b].tolist())
            steps.append((seq, len(seq.token_ids), number, *row))
        return proposal

    decoder.proposer.propose = recording
    return steps


def tokens_per_step(steps: list, c: int, widths: tuple[int, ...]) -> float:
    """Mean tokens per step had each step verified the sub-tree of `widths` (C_d <= c) of its tree
    (c nodes per depth); steps whose continuation is shorter than the tree are left out."""
    total = counted = 0
    for seq, length, _, parent, nodes in steps:
        truth = seq.token_ids[length : length + len(widths)]
        if len(truth) < len(widths):
            continue
        spelled, best = [False] * len(nodes), 0
        for n in range(min(len(nodes), c * len(widths))):
            d, j = divmod(n, c)
            up = parent[n]
            if j < widths[d] and (up < 0 or spelled[up]) and nodes[n] == truth[d]:
                spelled[n], best = True, d + 1  # kept (j < C_d, parent kept) and on the row's path
        total, counted = total + 1 + best, counted + 1
    return total / max(counted, 1)


def shapes(c: int, k: int):
    """Every non-increasing width tuple of 1..k depths with widths <= c."""
    for depth in range(1, k + 1):
        yield from itertools.combinations_with_replacement(range(c, 0, -1), depth)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="default")
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--proposer", default="ngram+eagle")
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    pair = load_pair(args.pair, dtype="float32")
    decoder = SpecDecoder(pair, method="spec1", k=args.k, proposer=args.proposer, branches=args.branches)
    steps, start = record_trees(decoder), time.time()
    for prompts in by_category(args.prompts, args.per_category).values():
        decoder.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    c, k = args.branches, args.k
    full = tokens_per_step(steps, c, (c,) * k)
    measured = [1 + seq.accepted_per_step[n] for seq, length, n, _, _ in steps if len(seq.token_ids) >= length + k]
    best: dict[int, tuple[float, tuple]] = {}
    for widths in shapes(c, k):
        columns, rate = 1 + sum(widths), tokens_per_step(steps, c, widths)
        if columns not in best or rate > best[columns][0]:
            best[columns] = (rate, widths)
    result = {
        "command": "python experiments/tree_shapes.py " + " ".join(argv or []),
        "steps": len(steps),
        "seconds": round(time.time() - start, 1),
        "full_beam": {"offline": round(full, 4), "decoder": round(sum(measured) / max(len(measured), 1), 4)},
        "best_by_columns": [
            {"columns": n, "widths": "x".join(map(str, w)), "tokens_per_step": round(r, 3)}
            for n, (r, w) in sorted(best.items())
        ],
    }
    print("| verified columns | widths | tokens/step |\n|---|---|---|")
    for row in result["best_by_columns"]:
        print(f"| {row['columns']} | {row['widths']} | {row['tokens_per_step']:.2f} |")
    print(f"full beam {c}x{k}: offline {full:.3f}, decoder {result['full_beam']['decoder']:.3f} tokens/step")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
