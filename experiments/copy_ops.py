"""Per-call times of the small tensor operations a step runs besides the model's matmuls, in the
forms the engine uses against the plain ones: the ragged layout's slot writes (`slots.write`: a
scatter through integers of the same width, against a float scatter) and greedy picks
(`sampling.greedy`: argmax in float32, against argmax in the logits' own dtype).

    python experiments/copy_ops.py [--dtypes bfloat16,float32] [--threads 2] [--calls 200] [--json OUT]

Prints one line per operation, dtype and shape: microseconds per call (median of 5 rounds) for
the plain form and the engine's, and checks that both give the same result.

Feeds: docs/benchmarks.md, "What a step spends besides the model".
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from batchspec.cache.slots import write
from batchspec.core.sampling import greedy

WRITES = [(1, 1), (1, 5), (4, 3), (8, 5), (16, 2)]  # (rows, new entries per row) into 512 slots
LOGITS = [(1, 1), (1, 5), (4, 5), (8, 3)]  # (rows, positions) over SmolLM2's 49,152 ids


def per_call_us(fn, calls: int = 200, rounds: int = 5) -> float:
    """Median over rounds of the mean microseconds of one call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def slot_writes(dtype: torch.dtype, rows: int, q: int, calls: int) -> tuple[float, float]:
    """(float scatter, slots.write) into a SmolLM2 layer's slab [rows, 3, 512, 64]."""
    slab = torch.zeros(rows, 3, 512, 64, dtype=dtype)
    new = torch.randn(rows, 3, q, 64).to(dtype)
    starts = torch.randint(0, 512 - q, (rows,))
    index = (starts[:, None] + torch.arange(q))[:, None, :, None].expand(-1, 3, -1, 64)
    plain, mine = slab.clone(), slab.clone()
    plain.scatter_(2, index, new)
    write(mine, index, new)
    assert torch.equal(plain, mine)
    plain_us = per_call_us(lambda: slab.scatter_(2, index, new), calls)
    return plain_us, per_call_us(lambda: write(slab, index, new), calls)


def greedy_picks(dtype: torch.dtype, rows: int, q: int, calls: int) -> tuple[float, float]:
    """(argmax in `dtype`, sampling.greedy) over logits [rows, q, 49152]."""
    logits = torch.randn(rows, q, 49152).to(dtype)
    assert torch.equal(logits.argmax(dim=-1), greedy(logits))
    return per_call_us(lambda: logits.argmax(dim=-1), calls), per_call_us(lambda: greedy(logits), calls)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for op, fn, shapes in (("slot write", slot_writes, WRITES), ("greedy pick", greedy_picks, LOGITS)):
            for rows, q in shapes:
                plain, mine = fn(dtype, rows, q, args.calls)
                results.append({"op": op, "dtype": name, "rows": rows, "q": q, "plain_us": plain, "engine_us": mine})
                print(f"{op:12s} {name:9s} B={rows:<3d} q={q}  plain {plain:8.1f} us  engine {mine:8.1f} us")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
