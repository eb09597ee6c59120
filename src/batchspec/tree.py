"""Draft trees: several candidates per position, verified in one target forward.

A chain of k drafts is the tree with one child per node. `Tree` is any static shape over N nodes
(parents before children); `Tree.chain_with_alternatives(k, c)` is the one the step builds: the
proposer's chain d1..dk plus, at every depth, its c - 1 next-best tokens as leaves beside the chain
node (the head's logits already rank them, so they cost no extra drafting forward). Where the chain
breaks at depth i + 1, a leaf there that equals the target's pick is kept as well: one more token
from the same target forward.

Verification feeds `[pending, nodes]`; a node sees the committed tokens and its own ancestors only
(`restrict`: the mask and positions of a tree forward). Acceptance (`accept`) walks from the root,
following the child equal to the target's pick at its parent: the same rule as a chain's, so the
output is still the target's own pick at every position. Afterwards the accepted path's cache
entries are moved to the chain's slots (`chain_order`), so the layouts roll back a tree exactly as
they roll back a chain whose first `num_accepted` drafts were kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import Outcome


@dataclass(frozen=True)
class Tree:
    """parent[n]: the node before node n (-1: the root, the row's last committed token). Parents
    come before children; nodes 0..k-1 are the chain (node i at depth i + 1)."""

    parent: tuple[int, ...]

    @staticmethod
    def chain_with_alternatives(k: int, c: int) -> Tree:
        """The chain d1..dk (nodes 0..k-1), then for each depth 1..k, c - 1 leaves whose parent is
        the chain node one level up: nodes k + (i * (c - 1)) + j, j < c - 1, at depth i + 1."""
        chain = [i - 1 for i in range(k)]
        leaves = [i - 1 for i in range(k) for _ in range(c - 1)]
        return Tree(tuple(chain + leaves))

    def __len__(self) -> int:
        return len(self.parent)

    def depth(self) -> list[int]:
        """Depth of each node (the root's children: 1)."""
        out: list[int] = []
        for p in self.parent:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def ancestry(self, device=None) -> torch.Tensor:
        """[N, N] bool: [n, m] is True when m is n or one of its ancestors."""
        n = len(self.parent)
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parent):
            if p >= 0:
                anc[i] |= anc[p]
        return anc.to(device)


def nodes(drafts: torch.Tensor, alternatives: torch.Tensor) -> torch.Tensor:
    """drafts [B, k], alternatives [B, k, c-1] -> node tokens [B, k * c] in the order of
    `Tree.chain_with_alternatives(k, c)`."""
    return torch.cat([drafts, alternatives.flatten(1)], dim=1)


def restrict(inputs: dict, pending: int, tree: Tree) -> dict:
    """A layout's model kwargs for `pending + len(tree)` new columns (consecutive positions, causal
    mask) -> the same for a tree forward: node n at the position of its depth past the last pending
    column, attending to the committed tokens and to its ancestors among the nodes.

    The mask is a layout's 2-D padding mask [B, L] (new columns are its last ones) or its 4-D mask
    [B, 1, q, span] over slots, with the new columns written at slots `position_ids` (ragged)."""
    positions = inputs["position_ids"]
    b, q = positions.shape
    n, device = len(tree), positions.device
    anc = tree.ancestry(device)
    depth = torch.tensor(tree.depth(), device=device)
    mask = inputs["attention_mask"]
    if mask.dim() == 2:
        width = mask.shape[1]
        cols = torch.arange(width, device=device)
        rows = torch.arange(width - q, width, device=device)
        mask = (mask.bool()[:, None, :] & (cols[None, None, :] <= rows[None, :, None]))[:, None].clone()
        mask[:, 0, pending:, width - n :] = anc
    else:
        mask = mask.clone()
        slots = positions[:, pending:]  # [B, N]: where each row's nodes are written
        mask[:, 0, pending:].scatter_(2, slots[:, None, :].expand(b, n, n), anc.expand(b, n, n))
    tree_positions = positions.clone()
    tree_positions[:, pending:] = positions[:, pending - 1 : pending] + depth
    return {**inputs, "attention_mask": mask, "position_ids": tree_positions}


def accept(tokens: torch.Tensor, tree: Tree, choice: torch.Tensor, limit: torch.Tensor | None = None):
    """tokens [B, N] (the nodes), choice [B, N+1] (the target's pick at the root, then at each
    node), limit [B] (deepest depth a row may keep; None: all) -> (Outcome, path [B, k]).

    A node is kept when it and all its ancestors equal the target's pick at their parents; a row
    keeps its deepest kept node (the first in node order on a tie) and the path to it. Outcome
    tokens [B, k+1]: the path's tokens, then the target's pick at its end. path[b, j] is the node
    at depth j + 1 of row b's path (the chain node j beyond num_accepted: never read)."""
    depth = torch.tensor(tree.depth(), device=tokens.device)
    assert len(tree) > 0, "a tree has at least one node"
    parent_col = torch.tensor([p + 1 for p in tree.parent], device=tokens.device)
    matches = tokens == choice[:, parent_col]  # [B, N]: each node equals the pick at its parent
    if limit is not None:
        matches &= depth[None, :] <= limit.to(tokens.device)[:, None]
    anc = tree.ancestry(tokens.device)
    kept = ~((~matches).long() @ anc.long().T).bool()  # no ancestor-or-self mismatches
    n, k = len(tree), int(depth.max())
    score = torch.where(kept, depth * (n + 1) + (n - torch.arange(n, device=tokens.device)), 0)
    best_score, best = score.max(dim=1)
    num_accepted = best_score // (n + 1)
    path = torch.arange(k, device=tokens.device).expand(tokens.shape[0], k).clone()
    rows, cols = (anc[best] & kept).nonzero(as_tuple=True)  # each row's kept node and its ancestors
    path[rows, depth[cols] - 1] = cols
    out = torch.cat([tokens.gather(1, path), tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    end = torch.where(num_accepted > 0, path.gather(1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0] + 1, 0)
    out.scatter_(1, num_accepted[:, None], choice.gather(1, end[:, None]))
    return Outcome(tokens=out, num_accepted=num_accepted), path
