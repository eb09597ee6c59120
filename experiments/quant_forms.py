"""How fast PyTorch's weight-only kernels multiply a small batch of rows on this CPU (models/quant.py).

One sweep over SmolLM2-135M's 210 decoder weights (random values, its shapes), per row count M,
for each formulation: float32 and bfloat16 `F.linear`, bfloat16 through oneDNN's packed weights,
int8 (`_weight_int8pack_mm`, bfloat16 rows), int4 (`_weight_int4pack_mm_for_cpu`, groups of 32 and of 64),
and int8 dequantized to bfloat16 on the fly then `F.linear` (what a QuantLinear does above
DENSE_ROWS rows). The fastest of --runs sweeps counts.

    python experiments/quant_forms.py [--rows 1,2,4,8,16,32,64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F

from batchspec.models.quant import quantize_int4, quantize_int8

SHAPES = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]  # q, o, k, v, gate, up, down
LAYERS = 30


def _int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales)


def sweep(calls, rows: int, runs: int) -> float:
    """Milliseconds of the fastest of `runs` sweeps of calls [(fn, weight args, width)] over `rows` rows."""
    inputs = {}
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for fn, args, width, dtype in calls:
            x = inputs.setdefault((width, dtype), torch.randn(rows, width, dtype=dtype))
            fn(x, *args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.02 for _ in range(LAYERS) for o, i in SHAPES]
    bf16 = [w.bfloat16() for w in weights]
    forms = {
        "float32 F.linear": [(F.linear, (w,), w.shape[1], torch.float32) for w in weights],
        "bfloat16 F.linear": [(F.linear, (w,), w.shape[1], torch.bfloat16) for w in bf16],
        "bfloat16 oneDNN": [
            (
                lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                (torch.ops.mkldnn._reorder_linear_weight(w, None),),
                w.shape[1],
                torch.bfloat16,
            )
            for w in bf16
        ],
        "int8": [(torch.ops.aten._weight_int8pack_mm, quantize_int8(w), w.shape[1], torch.bfloat16) for w in weights],
        **{
            f"int4 (groups of {group})": [
                (
                    partial(_int4, group=group),
                    quantize_int4(w, group),
                    w.shape[1],
                    torch.bfloat16,
                )
                for w in weights
            ]
            for group in (32, 64)
        },
        "int8 dequantized": [
            (
                lambda x, q, s: F.linear(x, q.to(torch.bfloat16) * s[:, None]),
                quantize_int8(w),
                w.shape[1],
                torch.bfloat16,
            )
            for w in weights
        ],
    }
    table = {}
    print(f"{'M':>5} " + " ".join(f"{name:>18}" for name in forms) + "   (ms per sweep)")
    for rows in [int(r) for r in args.rows.split(",")]:
        table[rows] = {name: round(sweep(calls, rows, args.runs), 2) for name, calls in forms.items()}
        print(f"{rows:>5} " + " ".join(f"{table[rows][name]:>18.1f}" for name in forms))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"torch": torch.__version__, "threads": torch.get_num_threads(), "ms_per_sweep": table}, f, indent=1
            )


if __name__ == "__main__":
    main()
