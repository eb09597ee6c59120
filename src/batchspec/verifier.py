"""The target's side of a step: one forward over `[last committed, d1..dk]` per row.

`forward` is the single place a model is called by the batched methods; the batch layout
(`PaddedBatch`, `RaggedBatch`) supplies the mask, the per-row positions and the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .step import Layout


def forward(model, ids: torch.Tensor, inputs: dict, last_only: bool = False) -> torch.Tensor:
    """ids [B, q] -> logits [B, q, V] (or [B, 1, V] with last_only); the cache in `inputs` grows."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **inputs)
    return out.logits


def target_forward(target, batch: Layout, ids: torch.Tensor, features=None, last_only: bool = False) -> torch.Tensor:
    """Feed ids [B, q] to the target's cache in `batch`: `forward`. `features` (an eagle.Features,
    or None): also keep the target's final hidden states of these tokens, the ones its LM head
    reads (the decoder, then the LM head on the kept columns, as the model itself does)."""
    inputs = batch.inputs("target", ids.shape[1])
    if features is None:
        return forward(target, ids, inputs, last_only)
    hidden = target.get_decoder()(input_ids=ids, use_cache=True, **inputs).last_hidden_state
    features.write(batch.seqs, inputs["position_ids"], hidden)
    return target.get_output_embeddings()(hidden[:, -1:] if last_only else hidden)


def verify(target, batch: Layout, drafts: torch.Tensor, features=None) -> torch.Tensor:
    """drafts [B, k] -> target logits [B, k+1, V] at `[last, d1..dk]`, in one forward pass."""
    return target_forward(target, batch, torch.cat([batch.pending("target"), drafts], dim=1), features)
