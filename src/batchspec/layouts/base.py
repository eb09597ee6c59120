"""`Layout`: what a step needs of a batch layout, whatever the way it stores rows (padded,
ragged). A layout subclasses it, so the optional capabilities it lacks take the defaults declared
here and the step never probes for them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..cache import kv
from ..core.sequence import Sequence


@runtime_checkable
class Layout(Protocol):
    """What a step needs of a batch layout. Roles are "target" and the proposer's cache role."""

    seqs: list[Sequence]  # the running rows, in row order
    device: torch.device

    def __len__(self) -> int: ...

    def pending(self, role: str) -> torch.Tensor:
        """ids [B, q]: the committed tokens `role` has not cached yet (q >= 1)."""
        ...

    def inputs(self, role: str, q: int) -> dict:
        """Model kwargs (attention_mask, position_ids, cache) to feed q new tokens per row."""
        ...

    def mark(self, role: str) -> object:
        """An opaque point in `role`'s cache that `rewind` returns to."""
        ...

    def rewind(self, role: str, mark: object) -> None:
        """Forget the entries `role` was fed since `mark` (a draft head's drafting forwards)."""
        ...

    def realign(self) -> list[Sequence]:
        """After tokens were committed: restore the layout's invariants, drop finished rows."""
        ...

    def cached_counts(self, role: str) -> list[int]:
        """Real entries of each row in `role`'s cache (for the invariant checker)."""
        ...

    def row_cache(self, role: str, row: int) -> kv.SeqKV:
        """Row `row`'s real entries of `role`'s cache, oldest first."""
        ...

    def check_layout(self) -> None:
        """Assert the layout's structural invariants."""
        ...

    def keep_path(self, role: str, nodes: int, index: torch.Tensor) -> None:
        """After a draft tree's forward of `nodes` node columns: move each row's accepted path to the
        first k node slots (index [B, nodes]: the slot each slot takes its entry from; core/tree.py)."""
        ...

    # --- capabilities with defaults (a layout inherits them by subclassing `Layout`) ----------
    #: `warm` can feed a proposer's cache late: rows are admitted with the target's entries only
    #: while the speculation policy is lazy (it may plan plain steps for long).
    warms: bool = False

    def warm(self, proposer) -> int:
        """Feed `proposer`'s cache the rows it lacks (admitted while nothing was drafted); the number
        of tokens fed (0: nothing to do, the default)."""
        return 0

    def cold(self, role: str) -> int:
        """Tokens `warm` would feed role's cache now (0 by default)."""
        return 0

    def adopt(self, role: str, dtype: torch.dtype) -> None:
        """At prefill, `role`'s cache takes a copy of the target's entries (in `dtype`) instead of a
        forward: a draft that is the target's own copy (`Proposer.kv_from_target`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy the target's entries")

    def attended_span(self) -> int:
        """The slots a row's attention reads in the next forward, on average, near enough: by default
        the longest row's length (a padded batch attends that far for every row)."""
        return max(len(s) for s in self.seqs)
