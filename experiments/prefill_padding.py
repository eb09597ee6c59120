"""What does padding cost a batched prefill? The default pair's target prefills the same Spec-Bench
prompts (sorted by length, as static batches are formed) in left-padded batches of 16, 8, 4 and 1;
prints the total seconds per batch size (docs/benchmarks.md quotes it).

    python experiments/prefill_padding.py [--prompts ../shared/data/spec_bench/question.jsonl]

Feeds: docs/benchmarks.md, "How the numbers got here: three runs".
"""

from __future__ import annotations

import argparse
import time

import torch

from batchspec import load_pair
from batchspec.layouts.padded import column_positions, padding_mask
from batchspec.tools.prompts import read_prompts


def prefill_seconds(model, rows: list[list[int]]) -> float:
    width = max(map(len, rows))
    pad_left = torch.tensor([width - len(r) for r in rows])
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # [B, width], left-padded
    start = time.perf_counter()
    with torch.inference_mode():
        model(
            input_ids=ids,
            attention_mask=padding_mask(pad_left, width),
            position_ids=column_positions(pad_left, 0, width),
            logits_to_keep=1,
            use_cache=True,
        )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--every", type=int, default=15)
    args = ap.parse_args()
    pair = load_pair("default", dtype="float32")
    rows = sorted((pair.encode(p.text) for p in read_prompts(args.prompts, args.limit, args.every)), key=len)
    print(f"{len(rows)} prompts, {sum(map(len, rows))} tokens, lengths {len(rows[0])}..{len(rows[-1])}")
    prefill_seconds(pair.target, rows[:2])  # warm-up
    for batch in (16, 8, 4, 1):
        total = sum(prefill_seconds(pair.target, rows[i : i + batch]) for i in range(0, len(rows), batch))
        padded = sum(
            len(rows[min(i + batch, len(rows)) - 1]) * len(rows[i : i + batch]) for i in range(0, len(rows), batch)
        )
        print(f"batch {batch:>2}: {total:6.1f} s, {padded} padded tokens", flush=True)


if __name__ == "__main__":
    main()
