"""`ragged`: a realignment-free batch. Every row has its own cache offset; nothing is ever shifted.

Row b's real entries are its slots 0 .. count_b - 1, kept for each role (target, draft) in a
`slots.SlotCache`: one row of the slab of the row's size class (up to 256, 512, 1024, ... slots). A
forward of q new tokens per row writes them at slots o_b .. o_b + q - 1 (one scatter per class and
layer) with positions o_b + i and a 4-D mask in which query i of row b sees slots j <= o_b + i.
Rejected drafts are rolled back by not counting them: their slots are overwritten next step. No
unpad, no repad; attention reads views of the slabs, each class's rows up to its own longest row,
so a short row's step does not cost what a long row's does.

Under a lazy speculation policy (`-k auto`) a sequence is admitted with no draft entries; `warm`
feeds the draft its tokens when a step first drafts for it (a policy that drafts nothing never pays
for the draft's prefill).

Rows 0 .. n-1 run; a row that finishes is replaced by the last row (no entry moves: the caches
renumber it). Waiting sequences are admitted into free rows while others decode: prefilled in
bounded chunks between steps (admission.py; a long prompt neither pads short ones nor stalls the
running rows), then copied in once.

Memory: `kv_budget_tokens` bounds the tokens reserved across all rows. A sequence is admitted
only when its worst case (prompt + max_new_tokens + k + 1 draft slots) fits beside the
reservations of the running rows, so a running row never waits for memory. Memory itself is
allocated as rows fill: a row's slab row holds less than twice its entries (past 256), so the
slots allocated follow the tokens held (bench's `kv_peak_tokens`), not rows x longest request.
"""

from __future__ import annotations

import torch

from ..cache import kv, slots
from ..core.errors import BatchspecError
from ..core.sequence import Sequence
from .base import Layout
from .buckets import buckets
from .padded import PaddedBatch


def need(seq: Sequence, k: int) -> int:
    """KV slots a sequence may hold at most: prompt + new tokens + k + 1 for a step's drafts."""
    return seq.max_len + k + 1


class RaggedBatch(Layout):
    """Running sequences in rows 0..n-1, their entries in one `slots.SlotCache` per role;
    `counts[role][b]` entries of row b are real. Between `pending` and `realign`, `heads[role][b]`
    is the next write slot of a role fed this step (`fed`); a role not fed keeps its counts.
    `reserved` is the budget promised to the running rows and to the `incoming` sequences being
    prefilled for it."""

    warms = True  # rows are admitted without the draft's entries while the policy is lazy

    def __init__(self, models: dict, capacity: int, budget: int, k: int, pad_id: int, device):
        self.seqs: list[Sequence] = []
        self.capacity, self.budget, self.k, self.pad_id, self.device = capacity, budget, k, pad_id, device
        self.caches = {
            role: slots.SlotCache(m.config, kv.entry_dtype(m), device, capacity) for role, m in models.items()
        }
        self.counts = {role: torch.zeros(capacity, dtype=torch.long, device=device) for role in models}
        self.heads = {role: torch.zeros(capacity, dtype=torch.long, device=device) for role in models}
        self.fed: set[str] = set()  # roles fed since the last realign (a draft skips plain steps)
        self.reserved = self.incoming = 0
        self.peak_tokens = self.peak_bytes = 0  # most target slots / KV bytes allocated at once
        self.peak_held = 0  # most target entries held at once (what the slots are for)
        self.prefixes = None  # a prefixes.PrefixCache that keeps leaving rows' entries, or None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def free(self) -> int:
        return self.capacity - len(self.seqs) - self.incoming

    def fits(self, seq: Sequence, extra: list[Sequence] = ()) -> bool:
        """Whether `seq` (beside `extra`, not reserved yet) can start its prefill now: a free row
        and budget for its worst case."""
        want = sum(need(s, self.k) for s in [*extra, seq])
        return self.free > len(extra) and self.reserved + want <= self.budget

    def reserve(self, seqs: list[Sequence]) -> None:
        """Hold a row and worst-case budget for each of `seqs` while they are prefilled (memory is
        allocated as rows fill: slots.SlotCache)."""
        self.reserved += sum(need(s, self.k) for s in seqs)
        self.incoming += len(seqs)

    def unreserve(self, seqs: list[Sequence]) -> None:
        """Give back what `reserve` held for sequences that will not enter (done at prefill)."""
        self.reserved -= sum(need(s, self.k) for s in seqs)
        self.incoming -= len(seqs)

    def _lengths(self) -> torch.Tensor:
        return torch.tensor([len(s) for s in self.seqs], device=self.device)

    def pending(self, role: str) -> torch.Tensor:
        """The last q tokens of every row, q = the most any row lacks; rows lacking fewer re-feed
        already cached tokens (rewritten in place with the same values). A row shorter than q (a
        draft catching up after plain steps) re-feeds its first token at position 0 as often as
        needed: identical inputs, identical entries."""
        n = len(self.seqs)
        lengths = self._lengths()
        q = int((lengths - self.counts[role][:n]).max())
        self.heads[role][:n] = lengths - q
        self.fed.add(role)
        return torch.tensor(
            [[s.token_ids[max(0, len(s) - q + i)] for i in range(q)] for s in self.seqs],
            dtype=torch.long,
            device=self.device,
        )

    def inputs(self, role: str, q: int) -> dict:
        """Write the next q tokens of each row at its head; mask and positions per row."""
        n, cache = len(self.seqs), self.caches[role]
        start = self.heads[role][:n]
        positions = (start[:, None] + torch.arange(q, device=self.device)[None, :]).clamp(min=0)  # [n, q]
        cache.prepare(n, positions)  # size classes: each attends over its own rows' span
        mask = torch.arange(cache.span, device=self.device)[None, None, :] <= positions[:, :, None]  # [n, q, span]
        self.heads[role][:n] = start + q
        return {"attention_mask": mask[:, None], "position_ids": positions, "cache": cache}

    def _measure(self) -> None:
        """Track the peaks of the target's slots allocated and entries held, and of the bytes
        allocated (all roles). Called once a step, before retiring: slabs grow only as rows are
        admitted or fed, and shrink only as rows leave."""
        self.peak_tokens = max(self.peak_tokens, self.caches["target"].allocated)
        self.peak_held = max(self.peak_held, self.tokens_held())
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes())

    def allocated_bytes(self) -> int:
        """KV bytes the slabs hold now, all roles."""
        return sum(cache.allocated * cache.bytes_per_token for cache in self.caches.values())

    def mark(self, role: str) -> torch.Tensor:
        """What `rewind` returns `role` to: each row's next write slot now."""
        return self.heads[role][: len(self.seqs)].clone()

    def rewind(self, role: str, mark: torch.Tensor) -> None:
        """Forget what `role` was fed since `mark` (the slots are overwritten later)."""
        self.heads[role][: len(self.seqs)] = mark

    def keep_path(self, role: str, nodes: int, index: torch.Tensor) -> None:
        """After a draft tree's forward (its nodes each row's last `nodes` slots written): node slot
        j of row b takes the entry of node slot index[b, j] (index [B, nodes]; tree.py)."""
        self.caches[role].reorder(self.heads[role][: len(self.seqs)] - nodes, index)

    def realign(self) -> list[Sequence]:
        """No realignment: count the entries that hold committed tokens, then retire finished rows."""
        n = len(self.seqs)
        lengths = self._lengths()
        for role in self.fed:
            self.counts[role][:n] = torch.minimum(self.heads[role][:n], lengths - 1)
        self.fed.clear()
        self._measure()
        return self.retire()

    def retire(self) -> list[Sequence]:
        """Remove finished rows: free their budget and slots (their entries kept by `prefixes`, if
        set); the last row takes the hole (no entry moves). Returns the removed sequences."""
        finished = [s for s in self.seqs if s.finished]
        for row in sorted((i for i, s in enumerate(self.seqs) if s.finished), reverse=True):
            last = len(self.seqs) - 1
            self.reserved -= need(self.seqs[row], self.k)
            if self.prefixes is not None:
                counts = {role: int(self.counts[role][row]) for role in self.caches}
                entries = {role: cache.row(row, counts[role]) for role, cache in self.caches.items()}
                self.prefixes.put(self.seqs[row], entries, counts)
            for role, cache in self.caches.items():
                cache.release(row)
                if row != last:
                    cache.move_row(last, row)
                    self.counts[role][row] = self.counts[role][last]
            self.seqs[row] = self.seqs[last]
            self.seqs.pop()
        return finished

    def admit(self, batch: PaddedBatch) -> None:
        """Take over the reserved rows of a prefilled padded batch (their entries, copied once)."""
        starts = batch.pad_left.tolist()
        for role, cache in batch.caches.items():
            for i, entries in enumerate(kv.split(cache, starts)):
                if entries:  # a role not fed at admission (lazy) holds none: `warm` feeds it later
                    self.caches[role].install(len(self.seqs) + i, entries)
                self.counts[role][len(self.seqs) + i] = kv.count(entries)
        self.incoming -= len(batch.seqs)
        self.seqs.extend(batch.seqs)

    def _cold_rows(self, role: str) -> list[int]:
        """Rows whose `role` cache holds nothing yet (and that have tokens to feed), shortest first."""
        rows = (b for b in range(len(self.seqs)) if int(self.counts[role][b]) == 0 and len(self.seqs[b]) > 1)
        return sorted(rows, key=lambda b: len(self.seqs[b]))

    def cold(self, role: str) -> int:
        return self._to_feed(self._cold_rows(role))  # what `warm` would feed

    def _to_feed(self, rows: list[int]) -> int:
        """Tokens `warm` feeds rows `rows`: each one's committed tokens but the last."""
        return sum(len(self.seqs[b]) - 1 for b in rows)

    def warm(self, proposer) -> int:
        """Feed `proposer`'s cache the committed tokens (all but the last, as a prefill leaves it)
        of every row that holds none: rows admitted while a lazy policy drafted nothing. One
        padded forward per length bucket, each row's entries copied in once; or, for the target's
        own copy (`kv_from_target`), the target's entries of those tokens copied, without a
        forward. Returns the tokens fed."""
        role = proposer.role
        cold = self._cold_rows(role)
        if proposer.kv_from_target:
            return self._adopt(proposer, cold)
        for rows in buckets(cold, lambda b: len(self.seqs[b])):
            part = PaddedBatch(
                [self.seqs[b] for b in rows], kv.empty_caches({role: proposer.model}), self.pad_id, self.device
            )
            proposer.feed(part, part.pending(role)[:, :-1])  # rows are right-aligned: each drops its last
            for b, entries in zip(rows, kv.split(part.caches[role], part.pad_left.tolist())):
                self.caches[role].release(b)  # placed by no forward yet, but never twice
                self.caches[role].install(b, entries)
                self.counts[role][b] = kv.count(entries)
        return self._to_feed(cold)

    def _adopt(self, proposer, rows: list[int]) -> int:
        """Rows `rows` of `proposer`'s cache take the target's entries (in the proposer's dtype): the
        same tokens, the same positions; its later entries are its own."""
        role, target = proposer.role, self.caches["target"]
        for b in rows:
            count = int(self.counts["target"][b])  # every committed token but the last
            self.caches[role].release(b)
            self.caches[role].install(b, target.row(b, count))
            self.counts[role][b] = count
        if rows:
            proposer.seen(torch.tensor([t for b in rows for t in self.seqs[b].token_ids[:-1]], device=self.device))
        return self._to_feed(rows)

    def attended_span(self) -> int:
        """Slots a row's attention reads next step, on average (each size class's rows read up to
        their longest row: slots.SlotCache)."""
        longest: dict[int, list[int]] = {}
        for seq in self.seqs:
            entry = longest.setdefault(slots.slot_class(len(seq)), [0, 0])
            entry[0], entry[1] = entry[0] + 1, max(entry[1], len(seq))
        return sum(rows * span for rows, span in longest.values()) // len(self.seqs)

    def tokens_held(self) -> int:
        """Target entries held by the running rows."""
        return int(self.counts["target"][: len(self.seqs)].sum())

    # --- introspection for the invariant checker --------------------------------------------
    def cached_counts(self, role: str) -> list[int]:
        return self.counts[role][: len(self.seqs)].tolist()

    def row_cache(self, role: str, row: int) -> kv.SeqKV:
        return self.caches[role].row(row, int(self.counts[role][row]))

    def check_layout(self) -> None:
        assert len(self.seqs) <= self.capacity, "more rows than the batch holds"
        assert self.reserved <= self.budget, "more KV reserved than the budget"
        n = len(self.seqs)
        for role, cache in self.caches.items():
            assert set(cache.place) <= set(range(n)), f"{role}: slots held for rows that do not run"
            assert all(int(self.counts[role][b]) <= cache.room(b) for b in range(n)), f"{role}: entries past the slots"


def kv_budget(seqs: list[Sequence], k: int, budget: int | None, rows: int) -> int:
    """Tokens the KV cache may reserve across all rows: the stated budget, or enough for the `rows`
    largest requests at once. A request that cannot fit even alone is refused up front."""
    needs = sorted((need(s, k) for s in seqs), reverse=True)
    if budget is None:
        return sum(needs[:rows])
    if needs[0] > budget:
        s = max(seqs, key=lambda s: need(s, k))
        raise BatchspecError(
            f"request {s.index} needs {need(s, k)} KV slots ({s.prompt_len} prompt + "
            f"{s.max_len - s.prompt_len} new + {k + 1} for drafts) but the KV budget is {budget} tokens; "
            "raise --kv-budget or lower --max-new-tokens"
        )
    return budget
