"""The `ragged` method offline: every request known up front, admitted into a ragged batch
(layouts/ragged.py) by the engine loop the server runs too. `ar` runs the same with no proposer
(plain decoding with continuous batching: at 16 rows 1.22-1.38x the static padded batches it ran
before, the same tokens; docs/benchmarks.md)."""

from __future__ import annotations

from ..core.sequence import Sequence
from ..engine.loop import Loop
from ..engine.step import Context
from ..layouts.ragged import RaggedBatch, kv_budget

#: Offline admission's chunk: unbounded (measured: chunking offline cost `ragged` 0.91x -> 0.66x `ar`
#: at B = 8, docs/benchmarks.md).
OFFLINE_CHUNK = 1 << 62


def run(ctx: Context, seqs: list[Sequence], config) -> None:
    """Decode `seqs` in place: continuous admission (chunked prefill) into a ragged batch, as a
    client of the engine loop (loop.py) that the server runs too."""
    budget = kv_budget(seqs, ctx.slots, config.kv_budget_tokens, config.batch_size)
    batch = RaggedBatch(ctx.models(), config.batch_size, budget, ctx.slots, ctx.pad_id, ctx.device)
    # Offline every request is known and no client waits for a first token, so admission prefills
    # whatever fits at once (in length buckets) unless a chunk is given; the server chunks.
    chunk = config.prefill_chunk if config.prefill_chunk is not None else OFFLINE_CHUNK
    loop = Loop(ctx, batch, chunk, config.prefix_cache_tokens)
    # All requests are known up front, so admit shortest first (as static batches sort by length):
    # rows in flight then have similar lengths, and the attention span (up to the longest row) is
    # not wasted on a mix of short and long prompts.
    for seq in sorted(seqs, key=len):
        loop.add(seq)
    loop.run()
    ctx.stats.extra.update(
        kv_budget_tokens=budget,
        kv_peak_tokens=batch.peak_tokens,
        kv_peak_bytes=batch.peak_bytes,
        kv_peak_held_tokens=batch.peak_held,
        prefill_chunks=loop.admission.chunks,
        prefill_chunks_carried=loop.admission.carried,
        prefill_ends_carried=loop.admission.carried_ends,
    )
    if loop.prefixes is not None:
        ctx.stats.extra["prefix_cache"] = loop.prefixes.summary()
