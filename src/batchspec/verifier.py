"""The target's side of a step: one forward over `[last committed, d1..dk]` per row.

`forward` is the single place a model is called by the batched methods; the batch layout
(`PaddedBatch`, `RaggedBatch`) supplies the mask, the per-row positions and the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .eagle import decoder_features
from .tree import Tree, restrict

if TYPE_CHECKING:
    from .step import Layout


def forward(model, ids: torch.Tensor, inputs: dict, last_only: bool = False) -> torch.Tensor:
    """ids [B, q] -> logits [B, q, V] (or [B, 1, V] with last_only); the cache in `inputs` grows."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **inputs)
    return out.logits


def target_forward(target, batch: Layout, ids: torch.Tensor, features=None, last_only: bool = False) -> torch.Tensor:
    """Feed ids [B, q] to the target's cache in `batch`: `forward`. `features` (an eagle.Features,
    or None): also keep the target's features of these tokens (its final hidden states, the ones
    its LM head reads, and any aux layers'; the decoder, then the LM head on the kept columns, as
    the model itself does)."""
    inputs = batch.inputs("target", ids.shape[1])
    if features is None:
        return forward(target, ids, inputs, last_only)
    hidden, feats = decoder_features(target, features.aux_layers, input_ids=ids, use_cache=True, **inputs)
    features.write(batch.seqs, inputs["position_ids"], feats)
    return target.get_output_embeddings()(hidden[:, -1:] if last_only else hidden)


def verify(target, batch: Layout, drafts: torch.Tensor, features=None) -> torch.Tensor:
    """drafts [B, k] -> target logits [B, k+1, V] at `[last, d1..dk]`, in one forward pass."""
    return target_forward(target, batch, torch.cat([batch.pending("target"), drafts], dim=1), features)


@dataclass
class TreeForward:
    """What `settle` needs of a tree verification: the number of node columns, the chain-order
    positions of the fed columns [B, q], and the target's features there [B, q, F] (or None)."""

    nodes: int
    positions: torch.Tensor
    hidden: torch.Tensor | None


def verify_tree(target, batch: Layout, nodes: torch.Tensor, tree: Tree, features=None):
    """nodes [B, N] (tokens in `tree`'s order) -> (target logits [B, N+1, V] at `[last, nodes]`,
    a `TreeForward` for `settle`), in one forward pass with the tree's mask and positions."""
    pending = batch.pending("target")
    p = pending.shape[1]
    inputs = batch.inputs("target", p + nodes.shape[1])
    chain_positions = inputs["position_ids"]
    inputs = restrict(inputs, p, tree)
    ids = torch.cat([pending, nodes], dim=1)
    if features is None:
        return forward(target, ids, inputs)[:, p - 1 :], TreeForward(len(tree), chain_positions, None)
    hidden, feats = decoder_features(target, features.aux_layers, input_ids=ids, use_cache=True, **inputs)
    logits = target.get_output_embeddings()(hidden[:, p - 1 :])
    return logits, TreeForward(len(tree), chain_positions, feats)


def settle(batch: Layout, fed: TreeForward, path: torch.Tensor, features=None) -> None:
    """After a tree's acceptance: move each row's path (path [B, k], node index by depth) to the
    chain's slots of the target's cache, and keep the target's features of the pending tokens and
    the path, so the layout rolls back as after a chain (the first num_accepted kept)."""
    b, k = path.shape
    chain = torch.arange(k, device=path.device)
    if not bool((path == chain).all()):
        index = torch.arange(fed.nodes, device=path.device).expand(b, fed.nodes).clone()
        index[:, :k] = path
        batch.keep_path("target", fed.nodes, index)
    if features is not None and fed.hidden is not None:
        p = fed.hidden.shape[1] - fed.nodes
        picked = fed.hidden[:, p:].gather(1, path[:, :, None].expand(-1, -1, fed.hidden.shape[2]))
        features.write(batch.seqs, fed.positions[:, : p + k], torch.cat([fed.hidden[:, :p], picked], dim=1))
