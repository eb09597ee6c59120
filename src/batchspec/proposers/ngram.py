"""`NgramProposer`: prompt lookup in the row's own tokens; no model, no cache (role None)."""

from __future__ import annotations

import weakref

import torch

from ..core.sampling import RowParams
from ..layouts.base import Layout
from .base import Proposal, Proposer, StopRule


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it. No model, no cache. A draft's
    bin is the length n of the match that proposed it."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self.bins = max_n + 1
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        found = []
        for seq in batch.seqs:
            index = self.indexes.get(seq)
            if index is None:
                index = self.indexes[seq] = NgramIndex(self.max_n, self.min_n)
            found.append(index.lookup(seq.token_ids, k))
        device = batch.device
        counts = torch.tensor([len(r) for r, _ in found], device=device)
        drafts = torch.tensor([r + [0] * (k - len(r)) for r, _ in found], dtype=torch.long, device=device)
        signal = torch.tensor([[n] * k for _, n in found], dtype=torch.long, device=device)
        return Proposal(drafts, counts, signal)


class NgramIndex:
    """`lookup_match` in O(k + max_n) per call over a growing token list: for each n, the latest
    start of every n-gram that has a follower, updated with the tokens added since the last call.
    Valid because a sequence's tokens only ever grow."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.done = 0  # n-grams starting before ... are indexed once they have a follower

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        length = len(tokens)
        for n, table in self.last.items():  # n-grams at start s need s + n <= length - 1
            for start in range(max(0, self.done - n), length - n):
                table[tuple(tokens[start : start + n])] = start
        self.done = length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.last[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + k], n
        return [], 0


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens[-n:], trying the
    longest n first; [] when nothing matches."""
    return lookup_match(tokens, k, max_n, min_n)[0]


def lookup_match(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> tuple[list[int], int]:
    """`lookup`, and the length n of the suffix that matched (0 when nothing did)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first, excluding the suffix itself
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow, n
    return [], 0
