"""EQSPEC realignment (unpad - append - repad) as a pure function of index tensors.

After a verification step every row of a left-padded batch has grown by a different amount, and
its cache holds some rejected drafts at the end. Realignment keeps, for each row and each model
("role"), the first `keep_b` real entries of its cache and right-aligns them in a new, minimal
width, so that KV slot j of row b again holds the token in padded column j of row b.

Convention (stated once, used everywhere): a role with lag L holds every committed token of a
row but the last L; the target always has L = 1 (its next input is the last committed token);
the draft has L = 1, or L = 2 after a step in which some row accepted all k drafts (the last
draft was never fed to the draft model, so it is re-fed with the bonus token), or more after plain
steps that did not run it (adaptive speculation); it catches up on its next forward.

Everything here is index arithmetic on small integer tensors; `kv.py` applies the resulting
index to every layer with one gather, or truncates the cache where no row's entries move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolePlan:
    """How one role's cache moves: new[b, :, j] = old[rows[b], :, index[b, j]] for j < width."""

    index: torch.Tensor | None  # [B', width]; None when every row keeps its columns: a truncation
    width: int  # the role's new cache width


@dataclass
class Plan:
    rows: torch.Tensor  # [B'] surviving rows, in order
    pad_left: torch.Tensor  # [B'] new left padding; min == 0
    width: int  # new padded length T' = max committed length
    roles: dict[str, RolePlan]


def shift_index(old_start: torch.Tensor, keep: torch.Tensor, old_width: int) -> torch.Tensor:
    """old_start [B], keep [B] -> index [B, W] with W = max(keep).

    Row b's kept entries sit at old columns old_start_b .. old_start_b + keep_b - 1 and move to new
    columns W - keep_b .. W - 1. Pad columns read a clamped (finite, masked-out) old column.
    """
    width = int(keep.max()) if keep.numel() else 0
    new_pad = width - keep
    cols = torch.arange(width, device=keep.device)
    index = (old_start - new_pad)[:, None] + cols[None, :]
    return index.clamp(0, max(old_width - 1, 0))


def plan(
    old_pad_left: torch.Tensor,  # [B]
    cache_widths: dict[str, int],  # per role, old cache width (uniform across rows)
    new_lengths: torch.Tensor,  # [B] committed lengths after this step
    alive: torch.Tensor,  # [B] bool: rows that stay in the batch
) -> Plan:
    """The realignment for every role, for the rows that stay."""
    rows = alive.nonzero().squeeze(-1)
    lengths = new_lengths[rows]
    old_pad = old_pad_left[rows]
    width = int(lengths.max()) if rows.numel() else 0
    pad_left = width - lengths
    same_rows = rows.numel() == old_pad_left.numel()
    roles = {}
    for role, old_width in cache_widths.items():
        cached = (old_width - old_pad).clamp(min=0)  # real entries of each row in the old cache
        lag = max(1, int((lengths - cached).max())) if rows.numel() else 1
        keep = (lengths - lag).clamp(min=0)  # a row shorter than a draft's lag keeps nothing
        new_width = width - lag
        # Every row grew by the same amount (always at B = 1): its entries stay in their columns,
        # and the move is a truncation to new_width (no copy).
        prefix = same_rows and new_width <= old_width and bool((pad_left == old_pad).all())
        index = None if prefix else shift_index(old_pad, keep, old_width)
        roles[role] = RolePlan(index=index, width=new_width)
    return Plan(rows=rows, pad_left=pad_left, width=width, roles=roles)
