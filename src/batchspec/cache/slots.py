"""`SlotCache`, the `ragged` layout's KV cache: each row's slots in one row of a slab per size class
(256, 512, 1024, ... slots), so memory follows the tokens held. Before each forward the batch says
where each row writes (`prepare`), and each class's rows are attended over their own span
(`RowParts`); attention reads views of the slabs (models/attention.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .kv import SeqKV, count, kv_heads

#: A SlotCache row's slots: FIRST_CLASS x 2**c in size class c. Each class in use costs a kernel
#: call per layer; starting at 256 keeps most short rows (prompt + answer) in one class.
FIRST_CLASS = 256


def slot_class(n: int) -> int:
    """The size class of a row holding up to n entries: the smallest c with FIRST_CLASS * 2**c >= n."""
    c = 0
    while FIRST_CLASS << c < n:
        c += 1
    return c


class RowParts:
    """A forward's keys (or values) as parts: each part's rows [m] of the batch and their slots
    [m, H_kv, span, D], a view of one size class's slab (attention.py). A forward whose rows are
    all in one class, in order, gets plain tensors instead."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]):
        self.parts = parts


def write(slab: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> None:
    """slab.scatter_(2, index, new); 16-bit floats as int16, the same bits: CPU kernels scatter
    bfloat16 element by element, 4-19x slower than int16 (experiments/copy_ops.py). Entries in
    another dtype than the slab's are converted (the batch-invariant mode's float32 slabs)."""
    new = new.to(slab.dtype)
    if slab.is_floating_point() and slab.element_size() == 2:
        slab.view(torch.int16).scatter_(2, index, new.view(torch.int16))
    else:
        slab.scatter_(2, index, new)


class SlotLayer(CacheLayerMixin):
    """One layer's slabs, one per size class in use: keys/values [rows, H_kv, FIRST_CLASS * 2**c, D]."""

    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.is_initialized, self.device = True, owner.device

    def lazy_initialization(self, key_states, value_states) -> None:  # slabs are the owner's business
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states [n, H, q, D]: scatter each row's new entries into its slab at the prepared
        write slots; return every class's rows over its own span (views, no copy): plain tensors
        when one class holds all rows in order, else `RowParts`."""
        keys, values = [], []
        for c, rows, index, span in self.owner.plan:  # index [m, q]
            idx = index[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[3])
            m = index.shape[0]
            for slab, new, out in ((self.keys[c], key_states, keys), (self.values[c], value_states, values)):
                part = slab[:m]
                write(part, idx, new if rows is None else new.index_select(0, rows))
                out.append((rows, part[:, :, :span]))
        if len(keys) == 1 and keys[0][0] is None:
            return keys[0][1], values[0][1]
        return RowParts(keys), RowParts(values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        return self.owner.span

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """A transformers Cache over per-row slots for up to `capacity` batch rows. A row's entries are
    slots 0.. of one row of the slab of its size class (`slot_class`: up to 256, 512, 1024, ...
    entries); a row that outgrows its class moves to a larger one (its entries copied once), a
    slab grows by rows as its class fills and is freed when its class empties. So memory follows
    the tokens the rows hold (each row's slab row is less than twice its entries, beyond the first
    class), and rows of a class attend together over that class's longest row only. Before each
    forward `prepare` places the rows and sets where each writes.

    Bookkeeping: `place[b] = (class, slab row)` of batch row b; `members[c]` the batch rows in
    class c's slab rows 0..m-1 (a slab's used rows are always its first ones)."""

    def __init__(self, config, dtype: torch.dtype, device, capacity: int, classes: bool = True):
        self.classes = classes  # False: every row in the longest row's class (one slab, one span)
        self.heads = kv_heads(config)
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.capacity, self.dtype, self.device = capacity, dtype, device
        super().__init__(layers=[SlotLayer(self) for _ in range(config.num_hidden_layers)])
        element = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_token = 2 * len(self.layers) * self.heads * self.dim * element  # all layers, K and V
        self.place: dict[int, tuple[int, int]] = {}
        self.members: dict[int, list[int]] = {}
        self.filled: dict[int, int] = {}  # batch row -> slots written (what a move copies)
        self.plan: list[tuple[int, torch.Tensor | None, torch.Tensor, int]] = []
        self.span = 0

    @property
    def allocated(self) -> int:
        """Token slots allocated, all slabs (per layer, keys or values)."""
        return sum(slab.shape[0] * slab.shape[2] for slab in self.layers[0].keys.values())

    def room(self, row: int) -> int:
        """Entries batch row `row` can hold without moving (0 if it holds none)."""
        return FIRST_CLASS << self.place[row][0] if row in self.place else 0

    def prepare(self, rows: int, positions: torch.Tensor) -> None:
        """Before a forward of q new entries for batch rows 0..rows-1 at slots positions [rows, q]:
        place rows that hold nothing yet, move rows that outgrow their class, plan the writes."""
        ends = (positions[:, -1] + 1).tolist()
        self.span = max(ends)
        for b, end in enumerate(ends):
            c = slot_class(end if self.classes else self.span)
            if b not in self.place:
                self._assign(b, c)
            elif end > self.room(b) or (not self.classes and self.place[b][0] != c):
                self._move(b, c)
            self.filled[b] = max(self.filled[b], end)
        self.plan = []
        for c, members in sorted(self.members.items()):
            if members == list(range(rows)):
                self.plan.append((c, None, positions, self.span))
                continue
            index = torch.tensor(members, device=self.device)
            self.plan.append((c, index, positions.index_select(0, index), max(ends[b] for b in members)))

    def install(self, row: int, entries: SeqKV) -> None:
        """Place batch row `row` (holding nothing) with one sequence's real entries, oldest first."""
        n = count(entries)
        self._assign(row, slot_class(max(n, 1)))
        c, i = self.place[row]
        for layer, (k, v) in zip(self.layers, entries, strict=True):
            layer.keys[c][i, :, :n] = k[0]
            layer.values[c][i, :, :n] = v[0]
        self.filled[row] = n

    def release(self, row: int) -> None:
        """Batch row `row` holds nothing from now on (its slab row is reused)."""
        if row not in self.place:
            return
        self.filled.pop(row)
        self._vacate(*self.place.pop(row))

    def move_row(self, src: int, dst: int) -> None:
        """Batch row `src` becomes batch row `dst` (which holds nothing): no entry is copied."""
        if src not in self.place:  # holds nothing either (a lazy draft's row not fed yet)
            return
        c, i = self.place[dst] = self.place.pop(src)
        self.filled[dst] = self.filled.pop(src)
        self.members[c][i] = dst

    def reorder(self, starts: torch.Tensor, index: torch.Tensor) -> None:
        """In place, for batch rows 0..n-1: slot starts[b] + j takes the entry of slot starts[b] +
        index[b, j] (index [n, N]); `kv.reorder` for the ragged layout."""
        slots = starts[:, None] + index  # [n, N]
        for c, members in self.members.items():
            rows = [b for b in members if b < index.shape[0]]
            if not rows:
                continue
            where = torch.tensor([self.place[b][1] for b in rows], device=self.device)
            batch_rows = torch.tensor(rows, device=self.device)
            src, dst = slots.index_select(0, batch_rows), starts.index_select(0, batch_rows)[:, None]
            dst = dst + torch.arange(index.shape[1], device=self.device)[None, :]
            for layer in self.layers:
                for slab in (layer.keys[c], layer.values[c]):
                    slab[where[:, None], :, dst] = slab[where[:, None], :, src]  # [m, N, H, D] each side

    def row(self, row: int, count_: int) -> SeqKV:
        """Batch row `row`'s first `count_` entries of every layer, as views."""
        if row not in self.place:
            return [(self._zeros(1, 0), self._zeros(1, 0)) for _ in self.layers]
        c, i = self.place[row]
        return [(layer.keys[c][i : i + 1, :, :count_], layer.values[c][i : i + 1, :, :count_]) for layer in self.layers]

    # --- slabs --------------------------------------------------------------------------
    def _zeros(self, rows: int, slots: int) -> torch.Tensor:
        return torch.zeros(rows, self.heads, slots, self.dim, dtype=self.dtype, device=self.device)

    def _assign(self, row: int, c: int) -> None:
        """Give batch row `row` the next free row of class c's slab (growing the slab if full)."""
        members = self.members.setdefault(c, [])
        have = self.layers[0].keys[c].shape[0] if c in self.layers[0].keys else 0
        if len(members) == have:
            grown = min(self.capacity, have + max(1, have // 2))  # by half: copies stay amortized
            for layer in self.layers:
                for slabs in (layer.keys, layer.values):
                    new = self._zeros(grown, FIRST_CLASS << c)
                    if have:
                        new[:have] = slabs[c]
                    slabs[c] = new
        self.place[row] = (c, len(members))
        self.filled.setdefault(row, 0)
        members.append(row)

    def _move(self, row: int, c: int) -> None:
        """Move batch row `row` to class c, copying its entries once."""
        old, i = self.place[row]
        self._assign(row, c)
        _, j = self.place[row]
        n = self.filled[row]
        for layer in self.layers:
            layer.keys[c][j, :, :n] = layer.keys[old][i, :, :n]
            layer.values[c][j, :, :n] = layer.values[old][i, :, :n]
        self._vacate(old, i)

    def _vacate(self, c: int, i: int) -> None:
        """Slab row i of class c is free: the slab's last used row fills the hole (or the slab is
        freed when it was the last)."""
        members = self.members[c]
        last = members.pop()
        if i < len(members):
            n = self.filled[last]
            for layer in self.layers:
                for slab in (layer.keys[c], layer.values[c]):
                    slab[i, :, :n] = slab[len(members), :, :n]
            members[i] = last
            self.place[last] = (c, i)
        if not members:
            del self.members[c]
            for layer in self.layers:
                del layer.keys[c], layer.values[c]
