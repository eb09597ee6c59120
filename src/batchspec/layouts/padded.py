"""`PaddedBatch`: B sequences as one left-padded rectangle, with a KV cache per model ("role").

The view (ids, mask, positions) is derived from the sequences' token lists and `pad_left`; the
batch never stores a copy of the ids. Invariants after every `realign`:
1. position of real token i of row b is i, whatever the padding (pads are masked, position 0);
2. the mask is 0 exactly on pad columns;
3. KV slot j of row b holds the key/value of the token in padded column j of row b;
4. a role with lag L has cache width T - L (target: L = 1; a draft L >= 1; see `realign.py`);
5. rejected drafts leave no trace; 6. min(pad_left) == 0.
Between a `feed` and the next `realign` the caches run ahead of the token lists (drafts).
"""

from __future__ import annotations

import torch

from ..cache import kv
from ..core.sequence import Sequence
from . import realign
from .base import Layout


def padding_mask(pad_left: torch.Tensor, width: int) -> torch.Tensor:
    """pad_left [B] -> [B, width] long, 0 on pad columns, 1 elsewhere."""
    cols = torch.arange(width, device=pad_left.device)
    return (cols[None, :] >= pad_left[:, None]).long()


def column_positions(pad_left: torch.Tensor, start: int, q: int) -> torch.Tensor:
    """Position ids [B, q] of padded columns start .. start+q-1 (pads get 0)."""
    cols = torch.arange(start, start + q, device=pad_left.device)
    return (cols[None, :] - pad_left[:, None]).clamp(min=0)


def padded_ids(seqs: list[Sequence], pad_id: int, width: int | None = None) -> torch.Tensor:
    """Left-padded token ids [B, width] (default width: the longest sequence)."""
    width = max(len(s) for s in seqs) if width is None else width
    rows = [[pad_id] * (width - len(s)) + s.token_ids[max(0, len(s) - width) :] for s in seqs]
    return torch.tensor(rows, dtype=torch.long)


class PaddedBatch(Layout):
    """Left-padded batch of sequences plus one `kv.BufferCache` per role (e.g. "target", "draft")."""

    def __init__(self, seqs: list[Sequence], caches: dict[str, kv.BufferCache], pad_id: int, device):
        self.seqs = list(seqs)
        self.caches = caches
        self.pad_id = pad_id
        self.device = device
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        self.width = int(lengths.max())
        self.pad_left = self.width - lengths

    def __len__(self) -> int:
        return len(self.seqs)

    def adopt(self, role: str, dtype: torch.dtype) -> None:
        """`role`'s cache becomes a copy of the target's, in `dtype` (a draft that is the target's own
        copy: the same columns, the same positions)."""
        kv.copy_into(self.caches[role], self.caches["target"], dtype)

    def cache_width(self, role: str) -> int:
        return kv.width(self.caches[role])

    def pending(self, role: str) -> torch.Tensor:
        """The committed tokens this role has not cached yet: ids [B, q], same q for every row."""
        q = self.width - self.cache_width(role)
        tail = [s.token_ids[-q:] if len(s) >= q else [self.pad_id] * (q - len(s)) + s.token_ids for s in self.seqs]
        return torch.tensor(tail, dtype=torch.long, device=self.device)

    def inputs(self, role: str, q: int) -> dict:
        """Model kwargs to feed q new columns per row to `role` (attention mask, positions, cache)."""
        start = self.cache_width(role)
        return {
            "attention_mask": padding_mask(self.pad_left, start + q),
            "position_ids": column_positions(self.pad_left, start, q),
            "cache": self.caches[role],
        }

    def mark(self, role: str) -> int:
        """What `rewind` returns `role`'s cache to: its entries now."""
        return self.cache_width(role)

    def rewind(self, role: str, mark: int) -> None:
        """Forget what `role` was fed since `mark` (a proposer's drafts it must not keep)."""
        kv.truncate(self.caches[role], mark)

    def keep_path(self, role: str, nodes: int, index: torch.Tensor) -> None:
        """After a draft tree's forward (its nodes the last `nodes` columns): node column j of row b
        takes the entry of node column index[b, j] (index [B, nodes]; tree.py)."""
        kv.reorder(self.caches[role], self.cache_width(role) - nodes, index)

    def realign(self) -> list[Sequence]:
        """After the step's tokens were committed to the sequences: drop finished rows, then unpad,
        append and repad every role's cache (one gather per layer). Returns the finished rows."""
        finished = [s for s in self.seqs if s.finished]
        if len(finished) == len(self.seqs):
            self.seqs = []
            return finished
        alive = torch.tensor([not s.finished for s in self.seqs], device=self.device)
        lengths = torch.tensor([len(s) for s in self.seqs], device=self.device)
        widths = {role: kv.width(cache) for role, cache in self.caches.items()}
        p = realign.plan(self.pad_left, widths, lengths, alive)
        full = p.rows.numel() == len(self.seqs)
        for role, rp in p.roles.items():
            if rp.index is None:
                kv.truncate(self.caches[role], rp.width)
            else:
                kv.gather(self.caches[role], p.rows, rp.index, full_batch=full)
        self.seqs = [self.seqs[i] for i in p.rows.tolist()]
        self.pad_left, self.width = p.pad_left, p.width
        return finished

    # --- introspection for the invariant checker and tests -------------------------------
    def cached_counts(self, role: str) -> list[int]:
        """Real (non-pad) entries of each row in `role`'s cache (a draft that lags by more than a
        short row's length holds none of that row yet)."""
        return (self.cache_width(role) - self.pad_left).clamp(min=0).tolist()

    def row_cache(self, role: str, row: int) -> kv.SeqKV:
        """Row `row`'s real entries of `role`'s cache, oldest first (views)."""
        return kv.split(self.caches[role], [int(self.pad_left[row])] * len(self.seqs))[row]

    def check_layout(self) -> None:
        """Invariants 1, 2, 4, 6 of the module docstring (3 and 5 need models: invariants.py)."""
        lengths = torch.tensor([len(s) for s in self.seqs], device=self.device)
        assert self.width == int(lengths.max()), "width is not the longest row"
        assert bool((self.pad_left == self.width - lengths).all()), "pad_left does not match row lengths"
        assert int(self.pad_left.min()) == 0, "padding accumulated: min(pad_left) > 0"
        assert self.cache_width("target") == self.width - 1, "target cache must hold all tokens but the last"
        for role in self.caches:
            assert self.width - self.cache_width(role) >= 1, f"{role}: cache width is not width - lag"
        mask = padding_mask(self.pad_left, self.width)
        positions = column_positions(self.pad_left, 0, self.width)
        for b, seq in enumerate(self.seqs):
            pad = int(self.pad_left[b])
            assert mask[b, :pad].sum() == 0 and bool(mask[b, pad:].all()), f"row {b}: mask not 0 exactly on pads"
            assert positions[b, pad:].tolist() == list(range(len(seq))), f"row {b}: positions skip or repeat"
