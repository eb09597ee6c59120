"""The engine iteration: retire cancelled sequences, admit waiting ones into free rows (chunked
prefill, admission.py), step the running rows (the step's forward may carry a prompt's chunk).
One code path for the offline `ragged` method (`ragged.run` drives it to completion) and the
online server (`online.OnlineEngine` drives it from a thread).

The loop holds a `ragged.RaggedBatch`. It never blocks and never talks to clients: requests'
outputs are handed out by `Context.observe` (see detok.py / online.py).
Invariant: after `iterate`, no row of the batch is finished or cancelled.
"""

from __future__ import annotations

import time
from collections import deque

from ..cache.prefixes import PrefixCache
from ..core.sequence import Sequence
from ..models.forward import carried
from .admission import Admission
from .step import Context, decode_step


class Loop:
    """Waiting and prefilling sequences (first in, first out) and the running batch."""

    def __init__(
        self,
        ctx: Context,
        batch,
        prefill_chunk: int | None = None,
        prefix_cache_tokens: int | None = None,
        max_gap_s: float | None = None,
        gap_steps: float | None = None,
    ):
        """`prefix_cache_tokens`: keep up to this many tokens of leaving rows' entries for later
        prompts that begin the same way (`prefixes`, a prefixes.PrefixCache; None: none).
        `max_gap_s`: the longest gap between a running row's steps that prefill may cause, and
        `gap_steps`: at most that many measured decode steps (admission.py)."""
        self.ctx, self.batch = ctx, batch
        self.prefixes = None
        if prefix_cache_tokens is not None:
            self.prefixes = PrefixCache(prefix_cache_tokens, ctx.features)
        self.admission = Admission(ctx, fixed_chunk=prefill_chunk, max_gap_s=max_gap_s, gap_steps=gap_steps)
        self.admission.prefixes = batch.prefixes = self.prefixes

    @property
    def waiting(self) -> deque[Sequence]:
        return self.admission.waiting

    def add(self, seq: Sequence) -> None:
        self.admission.add(seq)

    @property
    def busy(self) -> bool:
        return self.admission.busy or len(self.batch) > 0

    def sequences(self) -> list[Sequence]:
        """Every sequence the loop holds: waiting, being prefilled, running."""
        return [*self.admission.sequences(), *self.batch.seqs]

    def iterate(self) -> list[Sequence]:
        """Drop cancelled sequences, do one chunk of prefill work, then one decode step over the
        running rows. Returns the sequences that finished."""
        done = self._drop_cancelled()
        done += self.admission.admit(self.batch)
        if len(self.batch):
            rider = self.admission.rider  # a prompt chunk the step's forward may carry
            start = time.perf_counter()
            done += decode_step(self.ctx, self.batch, rider)
            ridden = rider.ids.numel() if carried(rider) else 0  # the rider's padded tokens, if carried
            self.admission.observe_step(time.perf_counter() - start, ridden)
        done += self.admission.settle(self.batch)
        return done

    def run(self) -> None:
        """Iterate until every sequence has finished (offline)."""
        while self.busy:
            self.iterate()

    def reset(self, batch) -> None:
        """Start afresh on an empty batch (after a failed step); waiting sequences stay."""
        self.batch = batch
        self.batch.prefixes = self.prefixes
        self.admission.partial = self.admission.rider = None

    def _drop_cancelled(self) -> list[Sequence]:
        """Finish cancelled sequences ("abort"): waiting ones leave the queue, a prefilling one
        gives back its reservation, running ones leave the batch now, freeing their rows and KV
        slots before the next step."""
        dropped = [s for s in self.sequences() if s.cancelled]
        if not dropped:
            return []
        self.admission.drop_cancelled(self.batch)
        for seq in dropped:
            if not seq.finished:
                seq.finish("abort")
        self.batch.retire()
        self.ctx.on_finish(dropped)
        return dropped
