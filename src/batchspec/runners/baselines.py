"""Deliberately broken batched speculative decoding: `bsp` and `dsd`.

These reproduce, on purpose, the two bug classes that make earlier batched implementations
non-equivalent (Su et al. 2023; Yan et al. 2025, as analysed in "Batch Speculative Decoding Done
Right", arXiv 2510.22876). They exist so that `batchspec verify` can be shown to catch real
synchronization bugs; never use them for generation.

- `bsp`: rejected drafts stay in the caches, hidden by holes in the attention mask, and position
  ids come from the padded column. Attention sees the right tokens, but every hole pushes the
  later positions one further: relative distances (RoPE) go wrong after the first rejection.
- `dsd`: at the first mismatch the row keeps the draft's token instead of the target's, and the
  batch is never trimmed (every row is padded to the width of the fastest row: padding
  accumulates). Positions and caches stay right; the committed token is wrong.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cache import kv
from ..core.acceptance import Outcome, accept
from ..layouts.padded import PaddedBatch, padding_mask
from .static import run_static


class BSPBatch(PaddedBatch):
    """Holes instead of realignment; positions are padded-column indices."""

    def __init__(self, seqs, caches, pad_id, device):
        super().__init__(seqs, caches, pad_id, device)
        self.base_pad = self.pad_left.clone()  # positions are counted from here, holes included
        self.valid = {role: torch.zeros(len(seqs), 0, dtype=torch.bool, device=device) for role in caches}
        self.uncached = {role: torch.tensor([len(s) for s in seqs], device=device) for role in caches}
        self.fed = {role: 0 for role in caches}  # columns fed since the last realign
        self.block = {role: 0 for role in caches}  # width of the pending block in them

    def pending(self, role: str) -> torch.Tensor:
        u = self.uncached[role].tolist()
        q = max(u)
        rows = [[self.pad_id] * (q - n) + s.token_ids[len(s) - n :] for s, n in zip(self.seqs, u)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def inputs(self, role: str, q: int) -> dict:
        start = self.cache_width(role)
        new = torch.ones(len(self.seqs), q, dtype=torch.bool, device=self.device)
        if int(self.uncached[role].max()) > 0:  # a pending block: short rows get leading holes
            block = int(self.uncached[role].max())
            new[:, :block] = torch.arange(block, device=self.device)[None, :] >= (block - self.uncached[role])[:, None]
            self.block[role], self.uncached[role] = block, torch.zeros_like(self.uncached[role])
        self.valid[role] = torch.cat([self.valid[role], new], dim=1)
        self.fed[role] += q
        cols = torch.arange(start, start + q, device=self.device)
        return {
            "attention_mask": self.valid[role].long(),
            "position_ids": (cols[None, :] - self.base_pad[:, None]).clamp(min=0),  # the bug
            "cache": self.caches[role],
        }

    def realign(self):
        finished = [s for s in self.seqs if s.finished]
        accepted = torch.tensor(
            [s.accepted_per_step[-1] if s.accepted_per_step else 0 for s in self.seqs], device=self.device
        )
        for role in self.caches:
            width, fed, block = self.cache_width(role), self.fed[role], self.block[role]
            drafts = fed - block  # draft columns fed after the pending block
            if drafts > 0:
                i = torch.arange(1, drafts + 1, device=self.device)
                self.valid[role][:, width - drafts :] &= i[None, :] <= accepted[:, None]  # holes
            self.uncached[role] = accepted + 1 - accepted.clamp(max=drafts)  # what the cache lacks
            self.fed[role] = self.block[role] = 0
        keep = torch.tensor([not s.finished for s in self.seqs], device=self.device).nonzero().squeeze(-1)
        if len(keep) < len(self.seqs):
            for role, cache in self.caches.items():
                kv.select_rows(cache, keep)
                self.valid[role] = self.valid[role][keep]
                self.uncached[role] = self.uncached[role][keep]
            self.base_pad = self.base_pad[keep]
            self.seqs = [self.seqs[i] for i in keep.tolist()]
        return finished


class DSDBatch(PaddedBatch):
    """Correct realignment, except that padding is never trimmed."""

    def realign(self):
        old_lengths = self.width - self.pad_left
        growth = max(len(s) - int(n) for s, n in zip(self.seqs, old_lengths))
        target_width = self.width + growth
        finished = super().realign()
        extra = target_width - self.width
        if self.seqs and extra > 0:
            for cache in self.caches.values():
                kv.pad_columns_left(cache, extra)
            self.pad_left = self.pad_left + extra
            self.width = target_width
        return finished

    def check_layout(self) -> None:  # padding accumulates by design
        lengths = torch.tensor([len(s) for s in self.seqs], device=self.device)
        assert bool(padding_mask(self.pad_left, self.width).sum(1).eq(lengths).all()), "mask does not cover the rows"


def dsd_accept(drafts, choice, limit) -> Outcome:
    """The standard rule, then the bug: at the first mismatch keep the draft token."""
    outcome = accept(drafts, choice, limit)
    k = drafts.shape[1]
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    rejected = outcome.num_accepted < k
    position = outcome.num_accepted.clamp(max=max(k - 1, 0))
    if k:
        tokens = outcome.tokens.clone()
        tokens[rows[rejected], position[rejected]] = drafts[rows[rejected], position[rejected]]
        outcome = Outcome(tokens, outcome.num_accepted)
    return outcome


def run_bsp(ctx, seqs, config) -> None:
    run_static(ctx, seqs, config.batch_size, BSPBatch)


def run_dsd(ctx, seqs, config) -> None:
    run_static(replace(ctx, accept=dsd_accept), seqs, config.batch_size, DSDBatch)
