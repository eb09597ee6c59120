"""Proposers: where draft tokens come from. They return draft ids (and, when sampling, the
distribution each was drawn from); acceptance lives in `acceptance.py`.

- `DraftProposer`: a small causal LM with its own KV cache (role "draft" of the batch layout),
  optionally with a reduced-vocabulary head (`vocab_ids` maps head index -> full-vocabulary id).
- `NgramProposer`: prompt lookup in the row's own tokens; no model, no cache (role None).

A row may propose fewer than k tokens (`num_proposed`); positions beyond are never accepted, so a
row behaves exactly as if it had been asked for that many, whatever the rest of the batch does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .sampling import RowParams, probabilities, sample
from .verifier import forward

if TYPE_CHECKING:
    from .step import Layout


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, k] full-vocabulary ids
    draft_probs: torch.Tensor | None  # [B, k, V] when sampling, else None
    num_proposed: torch.Tensor | None = None  # [B]; None means k for every row


@runtime_checkable
class Proposer(Protocol):
    """What the step needs of a proposer. `role` names the cache it keeps in the batch layout
    (None: no model, no cache); `model` is that cache's model (None without one)."""

    role: str | None
    model: torch.nn.Module | None

    def propose(self, batch: Layout, k: int, params: RowParams, uniforms: torch.Tensor | None) -> Proposal:
        """Up to k drafts per row of `batch` (a step.Layout); uniforms [B, k] when sampling."""
        ...


class DraftProposer:
    """Draft model proposer. Keeps its KV cache in the batch under role "draft"."""

    role = "draft"

    def __init__(self, model, vocab_size: int, vocab_ids: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = vocab_size  # the target's vocabulary (size of draft_probs' last dim)
        self.vocab_ids = vocab_ids  # [V_head] head index -> full id, or None for a full head

    def propose(self, batch: Layout, k: int, params: RowParams, uniforms: torch.Tensor | None) -> Proposal:
        """k tokens per row with k forwards: the pending tokens first, then each new draft but the
        last (whose KV is never needed unless all k are accepted; see realign.py's lag)."""
        ids = batch.pending(self.role)
        drafts, probs = [], []
        for i in range(k):
            logits = forward(self.model, ids, batch.inputs(self.role, ids.shape[1]), last_only=True)[:, -1]
            token, p = self._pick(logits, params, None if uniforms is None else uniforms[:, i])
            drafts.append(token)
            probs.append(p)
            ids = token[:, None]
        draft_probs = None if params.greedy else torch.stack(probs, dim=1)
        return Proposal(torch.stack(drafts, dim=1), draft_probs)

    def _pick(self, logits: torch.Tensor, params: RowParams, u: torch.Tensor | None):
        """logits [B, V_head] -> (full ids [B], full-vocabulary probs [B, V] or None)."""
        if params.greedy:
            idx = logits.argmax(dim=-1)
            return self._to_full(idx), None
        head_probs = probabilities(logits, params)
        idx = sample(head_probs, u).to(logits.device)
        if self.vocab_ids is None:
            return idx, head_probs
        full = head_probs.new_zeros(head_probs.shape[0], self.vocab_size)
        full[:, self.vocab_ids] = head_probs
        return self._to_full(idx), full

    def _to_full(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it. No model, no cache."""

    role = None
    model = None

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n

    def propose(self, batch: Layout, k: int, params: RowParams, uniforms: torch.Tensor | None) -> Proposal:
        rows = [lookup(s.token_ids, k, self.max_n, self.min_n) for s in batch.seqs]
        device = batch.device
        counts = torch.tensor([len(r) for r in rows], device=device)
        drafts = torch.tensor([r + [0] * (k - len(r)) for r in rows], dtype=torch.long, device=device)
        draft_probs = None
        if not params.greedy:
            proposed = torch.arange(k, device=device)[None, :] < counts[:, None]
            draft_probs = torch.zeros(len(rows), k, self.vocab_size, device=device)
            draft_probs.scatter_(2, drafts[..., None], proposed[..., None].float())
        return Proposal(drafts, draft_probs, counts)


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens[-n:], trying the
    longest n first; [] when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first, excluding the suffix itself
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []
