"""What every proposer returns (`Proposal`: draft ids, and for each a confidence bin that
adaptive speculation learns acceptance rates by) and what the step needs of one (`Proposer`).

- `DraftProposer` (draft.py): a small causal LM with its own KV cache (role "draft").
- `EagleProposer` (eagle.py): a draft head that reads the target's features (`features`), in the
  "draft" cache role.
- `NgramProposer` (ngram.py): prompt lookup in the row's own tokens; no model, no cache (role None).
- `LookupFirst` (lookup_first.py): lookup where it matches, a model proposer elsewhere.

A row may propose fewer than k tokens (`num_proposed`); positions beyond are never accepted, so a
row behaves exactly as if it had been asked for that many, whatever the rest of the batch does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..core.sampling import RowParams
from ..core.tree import Tree
from ..layouts.base import Layout
from .features import Features


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, k] full-vocabulary ids
    num_proposed: torch.Tensor | None = None  # [B]; None means k for every row
    signal: torch.Tensor | None = None  # [B, k] long: each draft's confidence bin (0 .. proposer.bins - 1)
    forwards: int | None = None  # proposer calls it took; None: one per draft (a model), one (a lookup)
    tree: Tree | None = None  # a draft tree (tree.py) whose nodes hold `nodes`; drafts is one of its paths
    nodes: torch.Tensor | None = None  # [B, len(tree)] full-vocabulary ids


#: Called by a proposer that drafts step by step, after draft i (0-based) with the bins so far
#: [B, i + 1]; returning True ends drafting for the whole batch (adaptive speculation).
StopRule = Callable[[int, torch.Tensor], bool]


@runtime_checkable
class Proposer(Protocol):
    """What the step needs of a proposer; a proposer subclasses it, so what it lacks takes the
    defaults below and the step never probes for it."""

    role: str | None = None  # the cache it keeps in the batch layout (None: no model, no cache)
    model: torch.nn.Module | None = None  # that cache's model
    bins: int = 1  # confidence bins of `Proposal.signal` (what adaptive speculation learns acceptance by)
    branches: int | tuple[int, ...] = 1  # nodes per depth of the draft tree it proposes (1: a chain)
    features: Features | None = None  # the target's features it reads, filled by every target forward
    # Its model is the target's own copy (same layers and heads: --draft self): its cache may start
    # from the target's entries instead of a prefill of its own (the ragged layout's `warm`).
    kv_from_target: bool = False
    rewinds: bool = False  # its cache keeps none of its drafts after a proposal (they may be replaced)

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        """Up to k drafts per row of `batch`. noise [B, k, V]: the Gumbel noise of the drafts'
        positions when sampling (core/sampling.py), else None."""
        ...

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        """Prefill: feed ids [B, q] to this proposer's cache; logits of the last column [B, 1, V].
        Called only for a proposer with a `role`."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cache")

    def seen(self, ids: torch.Tensor) -> None:
        """Tokens its cache took without a forward of its own (copied from the target's): a head
        that learns its vocabulary learns them (models/vocab.py)."""
