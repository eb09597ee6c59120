"""`ragged`: a realignment-free batch. Every row has its own cache offset; nothing is ever shifted.

Each role (target, draft) keeps one preallocated buffer per layer, [capacity, H_kv, S, D]; row b's
real entries are slots 0 .. count_b - 1. A forward of q new tokens per row writes them at slots
o_b .. o_b + q - 1 (one scatter per layer) with positions o_b + i and a 4-D mask in which query i
of row b sees slots j <= o_b + i. Rejected drafts are rolled back by not counting them: their
slots are overwritten next step. No unpad, no repad, no copy.

Rows are kept packed in slots 0 .. n-1, so every forward works on a view of the buffers. A row
that finishes is replaced by the last row (one row copy), and waiting sequences (shortest prompt
first) are admitted into the free slots at the end: prefilled together as a padded batch, then
copied in once. EXSPEC's pool comes for free.

The slot buffers themselves (`kv.SlotCache`) live in kv.py with every other cache.

The price: attention runs over slots up to the longest row for every row (masked), and the
buffers are sized for the longest request up front (`kv_budget_tokens` slots per row).
"""

from __future__ import annotations

from collections import deque

import torch

from . import kv
from .batch import PaddedBatch
from .errors import BatchspecError
from .sequence import Sequence
from .step import Context, decode_step, start


class RaggedBatch:
    """Active sequences in slots 0..n-1 of one SlotCache per role; `counts[role][b]` entries of
    row b are real. Between `pending` and `realign`, `heads[role][b]` is the next write slot."""

    def __init__(self, models: dict, capacity: int, slots: int, pad_id: int, device):
        self.seqs: list[Sequence] = []
        self.capacity, self.slots, self.pad_id, self.device = capacity, slots, pad_id, device
        self.caches = {
            role: kv.SlotCache(m.config, capacity, slots, next(m.parameters()).dtype, device)
            for role, m in models.items()
        }
        self.counts = {role: torch.zeros(capacity, dtype=torch.long, device=device) for role in models}
        self.heads = {role: torch.zeros(capacity, dtype=torch.long, device=device) for role in models}

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def free(self) -> int:
        return self.capacity - len(self.seqs)

    def _lengths(self) -> torch.Tensor:
        return torch.tensor([len(s) for s in self.seqs], device=self.device)

    def pending(self, role: str) -> torch.Tensor:
        """The last q tokens of every row, q = the most any row lacks; rows lacking fewer re-feed
        already cached tokens (rewritten in place with the same values)."""
        n = len(self.seqs)
        lengths = self._lengths()
        q = int((lengths - self.counts[role][:n]).max())
        self.heads[role][:n] = lengths - q
        return torch.tensor([s.token_ids[len(s) - q :] for s in self.seqs], dtype=torch.long, device=self.device)

    def inputs(self, role: str, q: int) -> dict:
        """Write the next q tokens of each row at its head; mask and positions per row."""
        n, cache = len(self.seqs), self.caches[role]
        start = self.heads[role][:n]
        steps = torch.arange(q, device=self.device)
        positions = start[:, None] + steps[None, :]  # [n, q]
        cache.rows, cache.write_index = n, positions
        cache.span = int(positions[:, -1].max()) + 1
        slots = torch.arange(cache.span, device=self.device)
        mask = slots[None, None, :] <= positions[:, :, None]  # [n, q, span]: causal, per row
        self.heads[role][:n] = start + q
        return {"attention_mask": mask[:, None], "position_ids": positions, "cache": cache}

    def realign(self) -> list[Sequence]:
        """No realignment: count the entries that hold committed tokens, then retire finished
        rows by moving the last row into their slot."""
        n = len(self.seqs)
        lengths = self._lengths()
        for role in self.caches:
            self.counts[role][:n] = torch.minimum(self.heads[role][:n], lengths - 1)
        finished = [s for s in self.seqs if s.finished]
        for row in sorted((i for i, s in enumerate(self.seqs) if s.finished), reverse=True):
            last = len(self.seqs) - 1
            if row != last:
                for role, cache in self.caches.items():
                    cache.move_row(last, row, int(self.counts[role][last]))
                    self.counts[role][row] = self.counts[role][last]
                self.seqs[row] = self.seqs[last]
            self.seqs.pop()
        return finished

    def admit(self, batch: PaddedBatch) -> None:
        """Take over the rows of a prefilled padded batch (their real entries, copied once)."""
        starts = batch.pad_left.tolist()
        for role, cache in batch.caches.items():
            for i, entries in enumerate(kv.split(cache, starts)):
                self.caches[role].install(len(self.seqs) + i, entries)
                self.counts[role][len(self.seqs) + i] = entries[0][0].shape[2] if entries else 0
        self.seqs.extend(batch.seqs)

    # --- introspection for the invariant checker --------------------------------------------
    def cached_counts(self, role: str) -> list[int]:
        return self.counts[role][: len(self.seqs)].tolist()

    def row_cache(self, role: str, row: int) -> kv.SeqKV:
        return self.caches[role].row(row, int(self.counts[role][row]))

    def check_layout(self) -> None:
        assert len(self.seqs) <= self.capacity, "more rows than slots"
        assert all(len(s) + 1 <= self.slots for s in self.seqs), "a row outgrew its slots"


def kv_budget(seqs: list[Sequence], k: int, budget: int | None) -> int:
    """Slots per row: the stated budget, or what the longest request needs (prompt +
    max_new_tokens + k draft slots). A request that cannot fit is refused up front."""
    need = max(s.max_len + k + 1 for s in seqs)
    if budget is None:
        return need
    too_long = [s for s in seqs if s.max_len + k + 1 > budget]
    if too_long:
        s = too_long[0]
        raise BatchspecError(
            f"request {s.index} needs {s.max_len + k + 1} KV slots ({s.prompt_len} prompt + "
            f"{s.max_len - s.prompt_len} new + {k + 1} for drafts) but the KV budget is {budget} per row; "
            "raise --kv-budget or lower --max-new-tokens"
        )
    return budget


def run(ctx: Context, seqs: list[Sequence], config) -> None:
    """Decode `seqs` in place: continuous admission into a ragged batch of `batch_size` rows."""
    slots = kv_budget(seqs, ctx.k, config.kv_budget_tokens)
    batch = RaggedBatch(ctx.models(), config.batch_size, slots, ctx.pad_id, ctx.device)
    bytes_per_row = sum(cache.bytes_per_row for cache in batch.caches.values())
    ctx.stats.extra.update(kv_budget_tokens=slots, kv_bytes=bytes_per_row * config.batch_size)
    # All requests are known up front, so admit shortest first (as static batches sort by length):
    # rows in flight then have similar lengths, and neither prefill padding nor the attention span
    # (up to the longest row) is wasted on a mix of short and long prompts.
    waiting = deque(sorted(seqs, key=len))
    while waiting or len(batch):
        if waiting and batch.free:
            newcomers = [waiting.popleft() for _ in range(min(batch.free, len(waiting)))]
            _admit(ctx, batch, newcomers)
            continue
        decode_step(ctx, batch)


def _admit(ctx: Context, batch: RaggedBatch, newcomers: list[Sequence]) -> None:
    """Prefill newcomers together (shortest first, as one padded batch) and move them in."""
    padded = start(ctx, sorted(newcomers, key=len))
    if len(padded):
        with ctx.stats.stage("schedule"):
            batch.admit(padded)
