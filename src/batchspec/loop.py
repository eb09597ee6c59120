"""The engine iteration: admit waiting sequences into free rows, step the running rows, retire
finished and cancelled ones. One code path for the offline `ragged` method (`ragged.run` drives
it to completion) and the online server (`online.OnlineEngine` drives it from a thread).

The loop holds a batch layout that admits rows (`ragged.RaggedBatch`: `free`, `admit(padded)`,
`retire()`, plus what `step.decode_step` needs). It never blocks and never talks to clients:
requests' outputs are handed out by `Context.observe` (see detok.py / online.py).
Invariant: after `iterate`, no row of the batch is finished or cancelled.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence
from .step import Context, decode_step, start


class Loop:
    """Waiting sequences (admitted first in, first out) and the running batch."""

    def __init__(self, ctx: Context, batch):
        self.ctx, self.batch = ctx, batch
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or len(self.batch) > 0

    def iterate(self) -> list[Sequence]:
        """Drop cancelled sequences, admit waiting ones into free rows (one prefill), then one
        decode step over the running rows. Returns the sequences that finished."""
        done = self._drop_cancelled()
        if self.waiting and self.batch.free:
            newcomers = [self.waiting.popleft() for _ in range(min(self.batch.free, len(self.waiting)))]
            done += self._admit(newcomers)
        if len(self.batch):
            done += decode_step(self.ctx, self.batch)
        return done

    def run(self) -> None:
        """Iterate until every sequence has finished (offline)."""
        while self.busy:
            self.iterate()

    def _admit(self, newcomers: list[Sequence]) -> list[Sequence]:
        """Prefill newcomers together (shortest first, as one padded batch) and move them in."""
        padded = start(self.ctx, sorted(newcomers, key=len))
        if len(padded):
            with self.ctx.stats.stage("schedule"):
                self.batch.admit(padded)
        return [s for s in newcomers if s.finished]

    def _drop_cancelled(self) -> list[Sequence]:
        """Finish cancelled sequences ("abort"): waiting ones leave the queue, running ones
        leave the batch now, freeing their rows and slots before the next step."""
        dropped = [s for s in self.waiting if s.cancelled] + [s for s in self.batch.seqs if s.cancelled]
        if not dropped:
            return []
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        for seq in dropped:
            if not seq.finished:
                seq.finish("abort")
        self.batch.retire()
        self.ctx.on_finish(dropped)
        return dropped
