"""The target's side of a step: one forward over `[last committed, drafts]` per row (a chain) or
over `[last committed, a draft tree's nodes]` (a tree, with its mask and positions), then the
acceptance of what the target picked. Chain or tree is decided once, in `verify`; `accept` and
the step read the result the same way.

The batch layout (`PaddedBatch`, `RaggedBatch`) supplies the mask, the per-row positions and the
cache; `models.forward.forward` is the single place a model is called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core import grammar
from ..core import tree as trees
from ..core.acceptance import Outcome
from ..core.tree import Tree, restrict
from ..layouts.base import Layout
from ..models.forward import Rider, decoder_features, forward
from ..proposers.base import Proposal
from ..proposers.features import Features


@dataclass
class Verified:
    """One verification: the target's logits [B, w + 1, V] at `[last, drafts]` (or the tree's
    nodes), and for a tree what acceptance needs to keep each row's path."""

    logits: torch.Tensor
    drafts: torch.Tensor  # [B, w] the chain verified, or the tree's first path
    tree: Tree | None = None
    nodes: torch.Tensor | None = None  # [B, len(tree)]
    fed: TreeForward | None = None

    @property
    def width(self) -> int:
        return self.drafts.shape[1]

    def offsets(self) -> torch.Tensor:
        """The noise position each logits column picks with [w + 1]: a chain's 0..w; the root, then
        each tree node's depth (a node at depth d reads the noise of position d)."""
        if self.tree is None:
            return torch.arange(self.width + 1)
        return torch.nn.functional.pad(self.tree.depth().cpu(), (1, 0))


def verify(
    target,
    batch: Layout,
    drafts: torch.Tensor,
    proposal: Proposal | None,
    features: Features | None,
    rider: Rider | None = None,
) -> Verified:
    """drafts [B, w] (the first w of the proposal's) -> the target's logits in one forward: over the
    proposal's draft tree cut at depth w where it drafted one, else over the chain (which may
    carry `rider`, another batch's tokens: models/forward.py)."""
    width = drafts.shape[1]
    if proposal is None or proposal.tree is None or width == 0:
        ids = torch.cat([batch.pending("target"), drafts], dim=1)
        return Verified(target_forward(target, batch, ids, features, rider=rider), drafts)
    shape = proposal.tree.cut(width)
    nodes = proposal.nodes[:, : len(shape)]
    logits, fed = verify_tree(target, batch, nodes, shape, features)
    return Verified(logits, drafts, shape, nodes, fed)


def accept(
    batch: Layout, verified: Verified, choice: torch.Tensor, limit: torch.Tensor | None, rule: Callable, features
) -> tuple[Outcome, torch.Tensor | None]:
    """choice [B, w + 1]: the target's pick at each column -> (the outcome, each row's accepted
    tree path [B, w] or None for a chain). A chain is judged by `rule` (acceptance.accept, or a
    baseline's broken one); a tree keeps each row's longest matching path (core/tree.py) and moves
    it to the chain's slots of the target's cache (`settle`), so the layout rolls back as after a chain."""
    if verified.tree is None:
        return rule(verified.drafts, choice, limit), None
    outcome, path = trees.accept(verified.nodes, verified.tree, choice, limit)
    settle(batch, verified.fed, path, features)
    return outcome, path


def checked(seqs: list, drafts: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor | None:
    """drafts [B, w], limit [B] (None: w) -> each constrained row's limit cut at its first draft
    the grammar refuses (it could never be kept: the masked target never picks it), so the layout
    and the stats count only drafts that can be kept."""
    if not grammar.constrained(seqs):
        return limit
    width = drafts.shape[1]
    counts = [width] * len(seqs) if limit is None else limit.tolist()
    rows = drafts.tolist()
    cut = [n if s.matcher is None else s.matcher.valid(row[:n]) for s, row, n in zip(seqs, rows, counts)]
    return torch.tensor(cut, dtype=torch.long, device=drafts.device)


def masks(seqs: list, verified: Verified, limit: torch.Tensor | None) -> torch.Tensor | None:
    """[B, columns, W] int32: the grammar's mask at each logits column of `verified` (after the
    drafts that lead to it: a chain's first i, a tree node's ancestry) for constrained rows,
    all-allowed elsewhere and for free rows; None when no row has a grammar."""
    if not grammar.constrained(seqs):
        return None
    columns = verified.logits.shape[1]
    if verified.tree is None:
        counts = [verified.width] * len(seqs) if limit is None else limit.tolist()
        bits = grammar.chain_masks(seqs, [row[:n] for row, n in zip(verified.drafts.tolist(), counts)])
    else:
        paths = [
            _tree_paths(nodes, parent) for nodes, parent in zip(verified.nodes.tolist(), verified.tree.parent.tolist())
        ]
        bits = grammar.row_masks(seqs, paths)
    return torch.nn.functional.pad(bits, (0, 0, 0, columns - bits.shape[1]), value=-1)


def _tree_paths(nodes: list[int], parent: list[int]) -> list[list[int]]:
    """One row's tree (tokens and parents, depth-major) -> the tokens from the root to each
    column: the root's (none), then each node's ancestry and itself."""
    paths: list[list[int]] = []
    for token, up in zip(nodes, parent):
        paths.append((paths[up] if up >= 0 else []) + [token])
    return [[]] + paths


def target_forward(
    target, batch: Layout, ids: torch.Tensor, features=None, last_only: bool = False, rider: Rider | None = None
) -> torch.Tensor:
    """Feed ids [B, q] to the target's cache in `batch`: `forward`. `features` (an eagle.Features,
    or None): also keep the target's features of these tokens (its final hidden states, the ones
    its LM head reads, and any aux layers'; the decoder, then the LM head on the kept columns, as
    the model itself does). `rider`: offered to the forward (its owner keeps its features)."""
    inputs = batch.inputs("target", ids.shape[1])
    if features is None:
        return forward(target, ids, inputs, last_only, rider)
    hidden, feats = decoder_features(target, features.aux_layers, rider, input_ids=ids, use_cache=True, **inputs)
    features.write(batch.seqs, inputs["position_ids"], feats)
    return target.get_output_embeddings()(hidden[:, -1:] if last_only else hidden)


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
