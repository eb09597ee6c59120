"""`LookupFirst`: per row, prompt lookup where it found a match of at least `MIN_MATCH` tokens,
else a model proposer's drafts (`--proposer ngram+eagle`, `ngram+draft`): lookup wins where the
answer copies its prompt, the model on open-ended text."""

from __future__ import annotations

import torch

from ..core.sampling import RowParams
from ..core.tree import is_tree
from ..layouts.base import Layout
from .base import Proposal, Proposer, StopRule
from .draft import DraftProposer
from .ngram import NgramProposer

#: `LookupFirst` takes a row's lookup drafts when they continue a match of at least this many tokens.
MIN_MATCH = 2


class LookupFirst(Proposer):
    """Prompt lookup first, a model proposer where lookup has no match of `min_match` tokens.
    The model's cache is rewound after each proposal (as the head's always is): rows that take the
    lookup's drafts leave no entries of the model's own drafts behind, and accepted tokens are fed
    to the model on the next step. Bins: the model's (0 .. model.bins - 1), then model.bins + the
    lookup's match length. In a chain the model is not called when every row takes the lookup's
    drafts. In a draft tree a lookup row's first node at each depth is the
    lookup's draft, beside the model's C_d - 1 best others, children of the lookup's nodes among
    them (the model drafts from the lookup's chain too, which its beam ranks as certain): so the
    model's guesses count where the lookup's break, and continue it past its end."""

    def __init__(self, model_proposer: DraftProposer, lookup: NgramProposer, min_match: int = MIN_MATCH):
        model_proposer.rewinds = self.rewinds = True
        self.inner, self.lookup, self.min_match = model_proposer, lookup, min_match
        self.role, self.model = model_proposer.role, model_proposer.model
        self.branches = model_proposer.branches
        self.bins = model_proposer.bins + lookup.bins
        self.features = model_proposer.features
        self.kv_from_target = model_proposer.kv_from_target

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.feed(batch, ids)

    def seen(self, ids: torch.Tensor) -> None:
        self.inner.seen(ids)

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        found = self.lookup.propose(batch, k, params, noise)
        take = (found.num_proposed > 0) & (found.signal[:, 0] >= self.min_match)  # [B] rows that take lookup's
        if bool(take.all()) and not is_tree(self.branches):
            return Proposal(found.drafts, found.num_proposed, found.signal + self.inner.bins, forwards=0)
        mine = torch.where(take[:, None], found.signal + self.inner.bins, 0)  # [B, k]

        def merged_stop(i: int, bins: torch.Tensor) -> bool:  # the policy sees each row's own source
            return stop(i, torch.where(take[:, None], mine[:, : i + 1], bins))

        merged = None if stop is None else merged_stop
        if is_tree(self.branches):  # a tree: the lookup chain first where a row takes it, the model's beam beside
            counts = torch.where(take, found.num_proposed, 0)
            drafted = self.inner._propose_tree(batch, k, params, noise, merged, (found.drafts, counts))
            signal = torch.where(take[:, None], mine[:, : drafted.drafts.shape[1]], drafted.signal)
            return Proposal(drafted.drafts, None, signal, tree=drafted.tree, nodes=drafted.nodes)
        drafted = self.inner.propose(batch, k, params, noise, merged)
        j = drafted.drafts.shape[1]
        counts = torch.where(take, found.num_proposed.clamp(max=j), j)
        drafts = torch.where(take[:, None], found.drafts[:, :j], drafted.drafts)
        signal = torch.where(take[:, None], mine[:, :j], drafted.signal)
        return Proposal(drafts, counts, signal)
