"""`EagleProposer`: the draft head (models/eagle.py) reading the target's own features, which the
step keeps per row in a `Features` store (features.py) from every target forward."""

from __future__ import annotations

import torch

from ..layouts.base import Layout
from .draft import DraftProposer
from .features import Features


class EagleProposer(DraftProposer):
    """A feature-conditioned draft head (eagle.py) in the draft's cache role. It reads the target's
    features of the committed tokens (kept in `features` by every target forward), drafts from its
    own predicted features, then rewinds its cache to the committed tokens: accepted drafts are
    re-fed with the target's true features on the next step, so every cached entry is one the
    head computes from the tokens alone (what the invariant checker recomputes)."""

    rewinds = True

    def __init__(self, model, vocab_size: int, branches: int = 1):
        super().__init__(model, vocab_size, model.vocab_ids, branches)
        self.features = Features(model.feature_size, model.aux)

    def _feed(self, batch: Layout, ids: torch.Tensor, carry: torch.Tensor | None = None, view=None):
        """(logits [B, 1, V_head], predicted feature [B, 1, H]) of the last of ids [B, q]; the
        feature inputs are the target's (`carry` None, [B, q, F]) or the head's own previous
        predictions ([B, q, H], no aux blocks). `view` (a tree's nodes): it rewrites the inputs'
        mask and positions, and every column's logits and features come back."""
        inputs = batch.inputs(self.role, ids.shape[1])
        if carry is None:
            carry = self.features.read(batch.seqs, inputs["position_ids"], self.model.dtype)
        keep = 1 if view is None else ids.shape[1]
        inputs = inputs if view is None else view(inputs)
        out = self.model(input_ids=ids, features=carry, use_cache=True, logits_to_keep=keep, **inputs)
        return out.logits, out.hidden_states
