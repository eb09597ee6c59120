"""The speed-of-light model: what a method would reach with zero engine overhead.

We time single forwards of the target and the draft on the same machine, in the same process, at
each batch size and query length a method uses, over a cache of representative length (held in
kv.py's slot buffers, so a forward is charged no cache copy; costmodel.time_forward). A
speculative step of a full batch of B rows then costs at least
    k x draft(B, 1) + target(B, k + 1)
and yields B x (mean tokens per step) tokens; plain decoding costs target(B, 1) per token row.
`efficiency = measured decode throughput / speed of light` says how much of the hardware's time
the engine turns into tokens; the rest is overhead (realignment, scheduling, Python, padding,
partly empty batches).
"""

from __future__ import annotations

from ..core import methods, tree
from ..policy.costmodel import time_forward


def forward_seconds(model, batch: int, query: int, context: int, repeats: int = 5) -> float:
    """Median wall time of one forward of `query` new tokens per row over `context` cached ones."""
    return time_forward(model, batch, query, context, repeats)


def cost_table(target, draft, batch_sizes: list[int], k_max: int, context: int) -> dict:
    """{"target": {B: {q: s}}, "draft": {B: {1: s}}} for q in 1 .. k_max + 1."""
    table = {"context": context, "target": {}, "draft": {}}
    for b in batch_sizes:
        table["target"][b] = {q: forward_seconds(target, b, q, context) for q in range(1, k_max + 2)}
        if draft is not None:
            table["draft"][b] = {1: forward_seconds(draft, b, 1, context)}
    return table


def speed_of_light(
    table: dict,
    method: str,
    batch: int,
    chosen_k: dict[int, int],
    tokens_per_step: float,
    has_draft: bool,
    branches: int | tuple[int, ...] = 1,
) -> float:
    """Decode tokens/s of a full batch with zero overhead, at the measured tokens per step. With
    varying k (`auto`) each step is charged at the k its rows verified, weighted by the measured
    histogram `chosen_k` {k: row steps}; a draft tree feeds 1 + its k depths' nodes columns."""
    target = table["target"][batch]
    if not methods.get(method).speculative or not chosen_k:
        return batch / target[1]
    total = sum(chosen_k.values())
    drafting = table["draft"][batch][1] if has_draft else 0.0
    step = sum(
        n / total * (k * drafting + target[min(1 + tree.columns(branches, k), max(target))])
        for k, n in chosen_k.items()
    )
    return batch * tokens_per_step / step
