"""The speed-of-light model: what a method would reach with zero engine overhead.

We time single forwards of the target and the draft on the same machine, in the same process, at
each batch size and query length a method uses, over a cache of representative length (held in
kv.py's in-place buffers, so a forward is charged no cache copy). A
speculative step of a full batch of B rows then costs at least
    k x draft(B, 1) + target(B, k + 1)
and yields B x (mean tokens per step) tokens; plain decoding costs target(B, 1) per token row.
`efficiency = measured decode throughput / speed of light` says how much of the hardware's time
the engine turns into tokens; the rest is overhead (realignment, scheduling, Python, padding,
partly empty batches).
"""

from __future__ import annotations

import statistics
import time

import torch

from . import kv, methods


@torch.inference_mode()
def forward_seconds(model, batch: int, query: int, context: int, repeats: int = 5) -> float:
    """Median wall time of one forward of `query` new tokens per row over `context` cached ones."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    cache = kv.empty(model.config)
    model(
        input_ids=torch.randint(vocab, (batch, context), generator=gen).to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    ids = torch.randint(vocab, (batch, query), generator=gen).to(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=query)
        sync(device)
        times.append(time.perf_counter() - start)
        kv.crop(cache, query)
    return statistics.median(times)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cost_table(target, draft, batch_sizes: list[int], k: int, context: int) -> dict:
    """{"target": {B: {q: s}}, "draft": {B: {1: s}}} for q in {1, k+1}."""
    table = {"context": context, "target": {}, "draft": {}}
    for b in batch_sizes:
        table["target"][b] = {q: forward_seconds(target, b, q, context) for q in sorted({1, k + 1})}
        if draft is not None:
            table["draft"][b] = {1: forward_seconds(draft, b, 1, context)}
    return table


def speed_of_light(table: dict, method: str, batch: int, k: int, tokens_per_step: float, has_draft: bool) -> float:
    """Decode tokens/s of a full batch with zero overhead, at the measured tokens per step."""
    target = table["target"][batch]
    if not methods.get(method).speculative:
        return batch / target[1]
    draft = k * table["draft"][batch][1] if has_draft else 0.0
    return batch * tokens_per_step / (draft + target[k + 1])
