"""Admission into a running batch without stalls or padding waste (chunked prefill).

Waiting sequences are prefilled between decode steps, at most `chunk` prompt tokens per engine
iteration (as Sarathi-Serve and vLLM do), so a long prompt never stalls the running rows for its
whole length: their step time grows by at most one chunk's cost. Short prompts that fit in the
chunk together are prefilled together, in length buckets (little padding); a prompt longer than
the chunk is fed alone, chunk by chunk, into its own cache, then moved into the batch once
complete (one copy).

The chunk follows measured costs: chunk = share x (decode step time) / (prefill time per token),
both exponential averages of the steps and prefills actually timed, so prefill adds about `share`
of a step to each step. While no row is running there is nothing to stall, and every waiting
prompt that fits is prefilled at once.

A policy that often drafts nothing (`-k auto`) leaves the proposer's cache empty here: the batch
feeds it a row's tokens when a step first drafts for that row (`RaggedBatch.warm`).

Invariant: a sequence holds a row and its worst-case KV budget (`batch.reserve`) from the moment
its prefill starts, so it can always be moved in when complete.
"""

from __future__ import annotations

import time
from collections import deque

from . import kv, tp
from .batch import PaddedBatch
from .sequence import Sequence, Status
from .static import buckets
from .step import Context, feed, prefill

MIN_CHUNK = 16  # a measured chunk never drops below this (tiny chunks waste a forward each)


class Admission:
    """Waiting sequences (first in, first out) and at most one prompt being fed in chunks."""

    def __init__(self, ctx: Context, fixed_chunk: int | None = None, share: float = 1.0, first_chunk: int = 256):
        self.ctx, self.fixed_chunk, self.share, self.first_chunk = ctx, fixed_chunk, share, first_chunk
        self.waiting: deque[Sequence] = deque()
        self.partial: PaddedBatch | None = None  # one row, fed chunk by chunk
        self.step_s: float | None = None  # decode step seconds (exponential average)
        self.token_s: float | None = None  # prefill seconds per prompt token (exponential average)
        self.chunks = 0  # prefill forwards that stopped short of a prompt's end

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.partial is not None

    def sequences(self) -> list[Sequence]:
        """Waiting sequences and the one being prefilled."""
        return list(self.waiting) + (self.partial.seqs if self.partial is not None else [])

    def drop_cancelled(self, batch) -> None:
        """Forget cancelled sequences; a cancelled prefill gives back its reservation."""
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        if self.partial is not None and self.partial.seqs[0].cancelled:
            batch.unreserve(self.partial.seqs)
            self.partial = None

    @property
    def chunk(self) -> int:
        """Prompt tokens one iteration may prefill while rows are running."""
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        if self.step_s is None or self.token_s is None:
            return self.first_chunk
        return max(MIN_CHUNK, int(self.share * self.step_s / self.token_s))

    def observe_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        per_token = seconds / max(tokens, 1)
        self.token_s = per_token if self.token_s is None else 0.8 * self.token_s + 0.2 * per_token

    def admit(self, batch) -> list[Sequence]:
        """One iteration's prefill work for `batch` (a RaggedBatch). Returns the sequences that
        finished at their first token (they never enter the batch)."""
        # None: nothing running, nothing to stall. A measured chunk is rank 0's on every rank (tp.py).
        limit = (self.chunk if self.fixed_chunk is not None else tp.agree(self.chunk)) if len(batch) else None
        spent, finished = 0, []
        if self.partial is not None:
            spent, finished = self._feed(batch, limit)
        while self.partial is None and self.waiting and batch.fits(self.waiting[0]):
            room = None if limit is None else limit - spent
            if room is not None and len(self.waiting[0]) > room:
                if spent:
                    break  # a long prompt starts next iteration, with a whole chunk
                self.partial = self._open(batch, self.waiting.popleft())
                return finished + self._feed(batch, limit)[1]
            group = [self.waiting.popleft()]
            while self.waiting and batch.fits(self.waiting[0], extra=group):
                if room is not None and sum(map(len, group)) + len(self.waiting[0]) > room:
                    break
                group.append(self.waiting.popleft())
            spent += sum(map(len, group))
            finished += self._prefill_group(batch, group)
        return finished

    def _open(self, batch, seq: Sequence) -> PaddedBatch:
        """A one-row padded batch with empty caches for a prompt to be fed in chunks."""
        batch.reserve([seq])
        seq.status = Status.RUNNING
        caches = {role: kv.empty(model.config) for role, model in self.ctx.models().items()}
        return PaddedBatch([seq], caches, self.ctx.pad_id, self.ctx.device)

    def _feed(self, batch, limit: int | None) -> tuple[int, list[Sequence]]:
        """Feed the partial prompt one chunk (every role), or finish its prefill and move it in."""
        part = self.partial
        left = part.width - part.cache_width("target")
        if limit is not None and left > limit:
            start = time.perf_counter()
            with self.ctx.stats.stage("prefill"):
                for role in _roles(self.ctx, batch):
                    feed(self.ctx, part, role, part.pending(role)[:, :limit])
            self._observe_prefill(limit, time.perf_counter() - start)
            self.chunks += 1
            return limit, []
        self.partial = None
        return left, self._complete(batch, part, left)

    def _prefill_group(self, batch, group: list[Sequence]) -> list[Sequence]:
        """Prefill whole prompts in length buckets and move them in."""
        batch.reserve(group)
        group = sorted(group, key=len)
        finished = []
        for rows in buckets(group):
            for seq in rows:
                seq.status = Status.RUNNING
            caches = {role: kv.empty(model.config) for role, model in self.ctx.models().items()}
            finished += self._complete(
                batch, PaddedBatch(rows, caches, self.ctx.pad_id, self.ctx.device), sum(map(len, rows))
            )
        return finished

    def _complete(self, batch, part: PaddedBatch, tokens: int) -> list[Sequence]:
        """Prefill what `part` lacks (first token included) and move its live rows into `batch`."""
        start = time.perf_counter()
        finished = prefill(self.ctx, part, _roles(self.ctx, batch))
        self._observe_prefill(tokens, time.perf_counter() - start)
        batch.unreserve(finished)
        if len(part):
            with self.ctx.stats.stage("schedule"):
                batch.admit(part)
        return finished


def _roles(ctx: Context, batch) -> list[str]:
    """Roles a prompt is fed to at admission: a lazy policy's proposer cache is fed later, by the
    batch (`warm`), if it can."""
    return ctx.admitted_roles() if hasattr(batch, "warm") else list(ctx.models())
