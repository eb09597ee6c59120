"""Draft trees: several candidates per position, verified in one target forward.

A chain of k drafts is the tree with one node per depth. `Tree` holds C_d nodes at depth d (its
`widths`, the same in every row), depth by depth, each node's parent one depth up, chosen per row.
The proposers build it as a beam (proposers/): at every depth the C_d most likely continuations of
the tree so far, by the drafter's cumulative log-probability, each drafted from its own parent's
predicted feature and cache entries (EAGLE-2's expansion). So a tree spends its columns where the
drafter expects the target's path, not only beside one chain; widths that narrow with depth
(`--branches 4x2x1`) spend them where acceptance is likeliest, the shallow depths.

Verification feeds `[pending, nodes]`; a node sees the committed tokens and its own ancestors only
(`restrict`: the mask and positions of a tree forward; `limit_view` for any run of written
columns, which the drafter's own tree forwards use too). Acceptance (`accept`) walks from the root,
following the child equal to the target's pick at its parent: the same rule as a chain's, so the
output is still the target's own pick at every position. Afterwards the accepted path's cache
entries are moved to the first k node slots (`settle`, engine/verify.py), so the layouts roll back a tree
exactly as they roll back a chain whose first `num_accepted` drafts were kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import Outcome


def listed(branches: int | tuple[int, ...]) -> tuple:
    """`branches` as the widths it lists: (C_1, C_2, ...) as given, else (C,) for one C at every depth."""
    return tuple(branches) if isinstance(branches, (tuple, list)) else (branches,)


def depth_widths(branches: int | tuple[int, ...], depths: int) -> tuple[int, ...]:
    """Nodes per depth of a tree of `depths` depths: `branches` C at every depth, or per depth
    (C_1, C_2, ...), the last repeated below the listed depths."""
    widths = listed(branches)
    return tuple(widths[min(d, len(widths) - 1)] for d in range(depths))


def columns(branches: int | tuple[int, ...], depths: int) -> int:
    """Draft columns a tree of `depths` depths feeds per row (a chain: `depths`)."""
    return sum(depth_widths(branches, depths))


def is_tree(branches: int | tuple[int, ...]) -> bool:
    """More than one node at some depth (else a chain)."""
    return max(listed(branches)) > 1


@dataclass(frozen=True)
class Tree:
    """parent [B, N] long: node n's parent in row b (-1: the root, the row's last committed token),
    a node one depth up; `widths` (C_1, .., C_D) nodes per depth, depth-major (N = sum C_d), so
    depth is the same in every row and a prefix of the nodes is the tree cut at a depth (`cut`)."""

    parent: torch.Tensor
    widths: tuple[int, ...]

    def __len__(self) -> int:
        return self.parent.shape[1]

    @property
    def depths(self) -> int:
        return len(self.widths)

    def starts(self) -> list[int]:
        """[D]: the first node of each depth (its best, as the proposers order a depth)."""
        return [sum(self.widths[:d]) for d in range(self.depths)]

    def depth(self) -> torch.Tensor:
        """[N]: depth of each node (the root's children: 1)."""
        counts = torch.tensor(self.widths, device=self.parent.device)
        return torch.arange(1, self.depths + 1, device=counts.device).repeat_interleave(counts)

    def ancestry(self) -> torch.Tensor:
        """[B, N, N] bool: [b, n, m] is True when m is n or one of its ancestors in row b."""
        b, n = self.parent.shape
        anc = torch.eye(n, dtype=torch.bool, device=self.parent.device).expand(b, n, n).clone()
        for i in range(self.widths[0], n):  # depth-major: a parent's row is final before its children's
            anc[:, i] |= anc[torch.arange(b, device=anc.device), self.parent[:, i]]
        return anc

    def cut(self, depth: int) -> Tree:
        """The nodes of depth <= `depth` (a prefix)."""
        return Tree(self.parent[:, : sum(self.widths[:depth])], self.widths[:depth])


def limit_view(inputs: dict, first: int, visible: torch.Tensor, positions: torch.Tensor) -> dict:
    """A layout's model kwargs for q new columns (written at consecutive slots after the earlier
    ones) -> the same where new columns first .. q - 1 see, of the last R written columns (the new
    ones the last of them), only those where visible [B, q - first, R] is True, and everything
    before those R; their position ids become `positions` [B, q - first].

    The mask is a layout's 2-D padding mask [B, L] (new columns are its last ones) or its 4-D mask
    [B, 1, q, span] over slots, with the new columns written at slots `position_ids` (ragged)."""
    slots = inputs["position_ids"]
    b, q = slots.shape
    r, device = visible.shape[2], slots.device
    mask = inputs["attention_mask"]
    if mask.dim() == 2:
        width = mask.shape[1]
        cols = torch.arange(width, device=device)
        rows = torch.arange(width - q, width, device=device)
        mask = (mask.bool()[:, None, :] & (cols[None, None, :] <= rows[None, :, None]))[:, None].clone()
        mask[:, 0, first:, width - r :] = visible
    else:
        mask = mask.clone()
        region = slots[:, -1:] - r + 1 + torch.arange(r, device=device)  # [B, R]: the last R slots written
        mask[:, 0, first:].scatter_(2, region[:, None, :].expand(b, q - first, r), visible)
    new_positions = slots.clone()
    new_positions[:, first:] = positions
    return {**inputs, "attention_mask": mask, "position_ids": new_positions}


def restrict(inputs: dict, pending: int, tree: Tree) -> dict:
    """A layout's model kwargs for `pending + len(tree)` new columns (consecutive positions, causal
    mask) -> the same for a tree forward: node n at the position of its depth past the last pending
    column, attending to the committed tokens and to its ancestors among the nodes."""
    last = inputs["position_ids"][:, pending - 1 : pending]
    return limit_view(inputs, pending, tree.ancestry(), last + tree.depth()[None, :])


def accept(tokens: torch.Tensor, tree: Tree, choice: torch.Tensor, limit: torch.Tensor | None = None):
    """tokens [B, N] (the nodes), choice [B, N+1] (the target's pick at the root, then at each
    node), limit [B] (deepest depth a row may keep; None: all) -> (Outcome, path [B, k]).

    A node is kept when it and all its ancestors equal the target's pick at their parents; a row
    keeps its deepest kept node (the first in node order on a tie) and the path to it. Outcome
    tokens [B, k+1]: the path's tokens, then the target's pick at its end. path[b, j] is the node
    at depth j + 1 of row b's path (beyond num_accepted: the depth's first node, never read)."""
    assert len(tree) > 0, "a tree has at least one node"
    device = tokens.device
    depth = tree.depth()
    matches = tokens == choice.gather(1, tree.parent + 1)  # [B, N]: each node equals the pick at its parent
    if limit is not None:
        matches &= depth[None, :] <= limit.to(device)[:, None]
    anc = tree.ancestry()
    kept = ~(anc & ~matches[:, None, :]).any(dim=2)  # no ancestor-or-self mismatches
    n, k = len(tree), tree.depths
    score = torch.where(kept, depth * (n + 1) + (n - torch.arange(n, device=device)), 0)
    best_score, best = score.max(dim=1)
    num_accepted = best_score // (n + 1)
    path = torch.tensor(tree.starts(), device=device).expand(tokens.shape[0], k).clone()
    rows, cols = (anc[torch.arange(len(best), device=device), best] & kept).nonzero(as_tuple=True)
    path[rows, depth[cols] - 1] = cols  # each row's kept node and its ancestors
    out = torch.cat([tokens.gather(1, path), tokens.new_zeros(tokens.shape[0], 1)], dim=1)
    end = torch.where(num_accepted > 0, path.gather(1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0] + 1, 0)
    out.scatter_(1, num_accepted[:, None], choice.gather(1, end[:, None]))
    return Outcome(tokens=out, num_accepted=num_accepted), path
