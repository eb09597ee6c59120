"""Where one compiled forward of a model's decoder spends its time, against its memory floor.

The default pair's target (or its own int4 copy, `--model self`) is fed one forward at a time as
the ragged layout feeds it (`costmodel.time_forward`: B rows of q tokens over S cached slots),
with each layer's attention planned once for the forward (attention.Planned) and without (every
layer calls the cache's `update` and the attention function), alternating, --rounds times: the
median wall time of each, their paired ratio, and a `torch.profiler` table of each grouped by kind
(products, attention kernels, cache writes, the engine's Python around them, the graph's own
kernels). The memory floor is the model's weight bytes over the bandwidth measured here (summing a
buffer of --stream-mb, the fastest of five), since a one-row forward reads every weight once.

    python experiments/forward_profile.py [--model target|self] [--shape 1x1] [--span 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchspec import load_pair
from batchspec.cache import kv, slots
from batchspec.models import attention
from batchspec.policy.costmodel import time_forward

#: profiler event names -> the kind of work they are (self CPU time; the rest is "other").
KINDS = {
    "products": (
        "aten::mm",
        "aten::addmm",
        "mkldnn::_linear_pointwise",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm",
    ),
    "product calls (Python around the kernels)": ("batchspec::product",),
    "attention kernels": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax"),
    "cache writes": ("aten::scatter_",),
    "attention calls (Python around the kernels)": ("batchspec::attend",),
    "the graph's own kernels and wrapper": ("## Call CompiledFxGraph None ##",),
}


def bandwidth(megabytes: int) -> float:
    """Bytes a second this process reads from memory: the fastest of five sums of a fresh buffer."""
    x = torch.ones(megabytes * 2**18)  # float32
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-row forward reads: the model's distinct parameters and buffers (a tied LM head
    counted once), less an input embedding table that is not also the LM head (one row is read)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    table = model.get_input_embeddings().weight
    seen, total = set(), 0
    if head is None or head.data_ptr() != table.data_ptr():
        seen.add(table.data_ptr())
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kinds(prof, forwards: int) -> dict[str, float]:
    """ms per forward by kind of work, from the profiler's self CPU times."""
    out = dict.fromkeys([*KINDS, "other"], 0.0)
    for event in prof.key_averages():
        kind = next((k for k, names in KINDS.items() if event.key in names), "other")
        out[kind] += event.self_cpu_time_total / 1e3 / forwards
    return {k: round(v, 2) for k, v in out.items()}


@torch.inference_mode()
def profiled(model, rows: int, q: int, span: int, forwards: int):
    """A profile of `forwards` forwards as `time_forward` feeds them, the cache made before it starts."""
    cache = slots.SlotCache(model.config, kv.entry_dtype(model), "cpu", rows)
    positions = torch.full((rows, 1), span) + torch.arange(q)[None, :]
    mask = (torch.arange(span + q)[None, None, :] <= positions[:, :, None])[:, None]
    ids = torch.zeros(rows, q, dtype=torch.long)

    def forward():
        cache.prepare(rows, positions)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)

    forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            forward()
    return prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("target", "self"), default="target")
    parser.add_argument("--shape", default="1x1", help="BxQ: rows x query tokens")
    parser.add_argument("--span", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=5, help="forwards per timing (their median)")
    parser.add_argument("--stream-mb", type=int, default=1024)
    parser.add_argument("--json")
    args = parser.parse_args()
    b, q = (int(v) for v in args.shape.split("x"))
    pair = load_pair(pair="default", dtype="float32", draft="self" if args.model == "self" else None)
    model = pair.draft if args.model == "self" else pair.target
    planned, general = attention.plan, lambda *a: None
    variants = {"planned": planned, "per layer": general}
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios = []
    for _ in range(args.rounds):
        for name, fn in variants.items():
            attention.plan = fn
            times[name].append(time_forward(model, b, q, args.span, repeats=args.calls))
        ratios.append(times["planned"][-1] / times["per layer"][-1])
    profiles = {}
    for name, fn in variants.items():
        attention.plan = fn
        profiles[name] = kinds(profiled(model, b, q, args.span, 10), 10)
    attention.plan = planned
    rate, size = bandwidth(args.stream_mb), weight_bytes(model)
    floor_ms = 1e3 * size / rate
    result = {
        "model": args.model,
        "rows": b,
        "q": q,
        "span": args.span,
        "threads": torch.get_num_threads(),
        "weight_mb": round(size / 2**20, 1),
        "bandwidth_gb_s": round(rate / 1e9, 1),
        "memory_floor_ms": round(floor_ms, 2),
        "ms": {name: round(1e3 * statistics.median(v), 2) for name, v in times.items()},
        "planned_per_layer_ratio": round(statistics.median(ratios), 3),
        "profile_ms": profiles,
    }
    result["over_floor"] = {name: round(ms / floor_ms, 2) for name, ms in result["ms"].items()}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result | {"torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
