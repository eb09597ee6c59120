"""Static batches: `spec1` and `eqspec` (and the broken baselines' loop).

B sequences are prefilled together and stepped until every row has finished (finished rows leave
the batch at once), then the next B are taken. Batches are formed from prompts sorted by length
and prefilled in length buckets, so one long prompt does not pad every row to its length; outputs
keep the input order. (`ar`, plain decoding, runs the ragged layout's continuous batching with
no proposer: ragged.py.)
"""

from __future__ import annotations

from ..core.sequence import Sequence
from ..engine.step import Context, decode_step, start
from ..layouts.buckets import buckets
from ..layouts.padded import PaddedBatch
from .store import Store


def start_bucketed(ctx: Context, seqs: list[Sequence]) -> PaddedBatch:
    """`start` for a static batch, prefilled in length buckets, then stacked into one padded batch."""
    seqs = sorted(seqs, key=len)
    groups = buckets(seqs)
    if len(groups) == 1:
        return start(ctx, seqs)
    store = Store(ctx)
    for group in groups:
        batch = store.prefill(group)
    live = [s for s in seqs if not s.finished]
    if not live:
        return batch  # empty: every row finished at its first token
    with ctx.stats.stage("realign"):
        batch = store.stack(live)
    if ctx.check is not None:
        ctx.check(batch)
    return batch


def run_static(ctx: Context, seqs: list[Sequence], batch_size: int, batch_cls: type = PaddedBatch) -> None:
    """Decode `seqs` in place, B at a time. A `batch_cls` other than PaddedBatch (the broken
    baselines) gets a one-shot padded prefill instead of buckets."""
    ordered = sorted(seqs, key=len)
    for first in range(0, len(ordered), batch_size):
        rows = ordered[first : first + batch_size]
        batch = start_bucketed(ctx, rows) if batch_cls is PaddedBatch else start(ctx, rows, batch_cls)
        while len(batch):
            decode_step(ctx, batch)


def run_eqspec(ctx: Context, seqs: list[Sequence], config) -> None:
    """Synchronous padded batches, realigned after every step (PaddedBatch.realign)."""
    run_static(ctx, seqs, config.batch_size)


def run_spec1(ctx: Context, seqs: list[Sequence], config) -> None:
    """Textbook speculative decoding, one sequence at a time."""
    run_static(ctx, seqs, 1)
