"""The only code that knows transformers' `Cache` classes: every KV cache batchspec uses.

- `BufferCache` (padded layouts: EQSPEC, EXSPEC's stacks, static batches): layers keep keys and
  values in preallocated buffers [B, H_kv, capacity, D]; columns [0, width) are the cache. A
  forward writes its new columns in place (the buffer doubles when full), so feeding a token costs
  no copy of the cache; transformers' `DynamicCache` concatenates, i.e. copies every layer's whole
  cache on every forward. Each function that moves entries (gather, stack) writes into a fresh
  buffer with `RESERVE` spare columns, enough for one speculative step without growing.
- `SlotCache` (the `ragged` layout) keeps each row's slots in one row of a slab per size class
  (256, 512, 1024, ... slots), so memory follows the tokens held; before each forward the batch says
  where each row writes, and each class's rows are attended over their own span (`RowParts`).
  Attention reads views of the slabs.
- `reference_cache` is transformers' own `DynamicCache`, for the oracle and the invariant checker:
  they must not share this module's buffer code, so a bug here cannot hide in both.

Which columns are real and which are padding is not the cache's business: the caller (a padded
batch, a per-sequence store, the ragged batch) keeps that. `SeqKV` is one sequence's share: a
list over layers of (keys, values) [1, H_kv, n, D] holding its n real entries, oldest first.

Only full-attention models are supported (`models.check_supported` refuses the rest). H_kv is the
heads this process holds: under tensor parallelism (tp.py) a rank holds its share (`kv_heads`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

SeqKV = list[tuple[torch.Tensor, torch.Tensor]]
RESERVE = 32  # spare columns allocated past the width whenever entries are moved
#: A SlotCache row's slots: FIRST_CLASS x 2**c in size class c. Each class in use costs a kernel
#: call per layer; starting at 256 keeps most short rows (prompt + answer) in one class.
FIRST_CLASS = 256


class BufferLayer(CacheLayerMixin):
    """One layer: `keys`/`values` buffers [B, H, capacity, D], of which columns [0, width) are in use."""

    is_sliding = False

    def __init__(self):
        super().__init__()
        self.width = 0

    def hold(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Use these buffers; their first `width` columns are the cache."""
        self.keys, self.values, self.width = keys, values, width
        self.device, self.is_initialized = keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        room = key_states.shape[2] + RESERVE
        self.hold(_room(key_states[:, :, :0], room), _room(value_states[:, :, :0], room), 0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new columns in place (doubling the buffers when full); return the cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, q = self.width, key_states.shape[2]
        if start + q > self.keys.shape[2]:
            room = max(2 * self.keys.shape[2], start + q + RESERVE)
            self.hold(_room(self.keys[:, :, :start], room), _room(self.values[:, :, :start], room), start)
        self.keys[:, :, start : start + q] = key_states
        self.values[:, :, start : start + q] = value_states
        self.width = start + q
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.width

    def get_max_length(self) -> int:
        return -1


class BufferCache(Cache):
    def __init__(self, config):
        super().__init__(layers=[BufferLayer() for _ in range(config.num_hidden_layers)])


def _room(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """A zeroed buffer of `capacity` columns whose first columns are a copy of t."""
    out = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


def empty(config) -> BufferCache:
    """A cache with no entries for a model with this config."""
    return BufferCache(config)


def empty_caches(models: dict) -> dict[str, BufferCache]:
    """An empty cache for each role's model: {role: model} -> {role: cache}."""
    return {role: empty(model.config) for role, model in models.items()}


def reference_cache(config) -> DynamicCache:
    """transformers' plain growing cache (the oracle's; independent of this module's buffers)."""
    return DynamicCache(config=config)


def unsupported_layers(config) -> set[str]:
    """Names of the cache layer types this config needs that are not plain full attention
    (sliding windows, recurrent state); empty when the model is supported."""
    return {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer}


def entry_dtype(model) -> torch.dtype:
    """The dtype of `model`'s KV entries: its own layers' (`model.dtype` where a draft or head tied
    to a target's embedding in another precision says so; transformers' models report their first
    floating parameter's)."""
    own = getattr(model, "dtype", None)
    return own if isinstance(own, torch.dtype) else next(model.parameters()).dtype


def kv_heads(config) -> int:
    """KV heads one process holds: all of them, or its share when transformers loaded the model
    tensor-parallel (the config then carries `distributed_config.tp_size`)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    tp_size = getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1
    return heads // tp_size


def count(layers: SeqKV) -> int:
    """Entries held by one sequence's share."""
    return layers[0][0].shape[2] if layers else 0


def width(cache: Cache) -> int:
    """Number of columns (the same for every layer and row)."""
    return cache.get_seq_length()


def truncate(cache: BufferCache, columns: int) -> None:
    """Forget every column from `columns` on (they are overwritten by the next forward)."""
    for layer in cache.layers:
        layer.width = min(layer.width, columns)


def tensors(cache: Cache) -> SeqKV:
    """Every layer's (keys, values) in use, as views; empty caches give []. Works for any
    transformers cache whose layers expose `keys`, `values` and `get_seq_length()`."""
    return [
        (layer.keys[:, :, : layer.get_seq_length()], layer.values[:, :, : layer.get_seq_length()])
        for layer in cache.layers
        if layer.is_initialized
    ]


def crop(cache: BufferCache, n: int) -> None:
    """Forget the last n columns (they are overwritten by the next forward)."""
    for layer in cache.layers:
        layer.width -= n


def gather(cache: BufferCache, rows: torch.Tensor, index: torch.Tensor, full_batch: bool) -> None:
    """In place: new[b, :, j] = old[rows[b], :, index[b, j]] for every layer (one gather each,
    written straight into a fresh buffer). index [B', W]; `full_batch`: rows is arange(B)."""
    width_ = index.shape[1]
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        new = []
        for old in (layer.keys, layer.values):
            src = old[:, :, : layer.width] if full_batch else old[:, :, : layer.width].index_select(0, rows)
            out = src.new_empty(src.shape[0], src.shape[1], width_ + RESERVE, src.shape[3])
            idx = index[:, None, :, None].expand(-1, src.shape[1], -1, src.shape[3])
            torch.gather(src, 2, idx, out=out[:, :, :width_])
            new.append(out)
        layer.hold(new[0], new[1], width_)


def reorder(cache: BufferCache, start: int, index: torch.Tensor) -> None:
    """In place, columns start..start+N of every row: new[b, :, start + j] = old[b, :, start +
    index[b, j]] (index [B, N]; a tree's accepted path moved to the chain's columns)."""
    n = index.shape[1]
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for t in (layer.keys, layer.values):
            region = t[:, :, start : start + n]
            idx = index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            region.copy_(region.gather(2, idx))


def select_rows(cache: BufferCache, rows: torch.Tensor) -> None:
    """In place: keep only `rows` of the batch."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def split(cache: Cache, starts: list[int]) -> list[SeqKV]:
    """Row b's entries from column starts[b] to the end, as views (no copy)."""
    layers = tensors(cache)
    return [[(k[b : b + 1, :, s:], v[b : b + 1, :, s:]) for k, v in layers] for b, s in enumerate(starts)]


def stack(config, seqs: list[SeqKV], take: list[int]) -> BufferCache:
    """Left-padded batch cache from per-sequence entries: row b gets the first take[b] entries of
    seqs[b], right-aligned in width max(take); pad slots are zero (finite, masked out).
    Sequences that all contribute the same number of entries are concatenated without padding."""
    width_ = max(take) if take else 0
    cache = BufferCache(config)
    if width_ == 0 or not seqs[0]:
        return cache
    for layer_idx, layer in enumerate(cache.layers):
        k = _left_pad_cat([s[layer_idx][0][:, :, :n] for s, n in zip(seqs, take)], width_)
        v = _left_pad_cat([s[layer_idx][1][:, :, :n] for s, n in zip(seqs, take)], width_)
        layer.hold(k, v, width_)
    return cache


def _left_pad_cat(parts: list[torch.Tensor], width_: int) -> torch.Tensor:
    """[1, H, n_b, D] pieces -> a buffer [B, H, width + RESERVE, D] whose first `width` columns
    hold each piece right-aligned."""
    head = parts[0]
    out = head.new_zeros(len(parts), head.shape[1], width_ + RESERVE, head.shape[3])
    if all(p.shape[2] == width_ for p in parts):
        torch.cat(parts, dim=0, out=out[:, :, :width_])
        return out
    for b, part in enumerate(parts):
        if part.shape[2]:
            out[b, :, width_ - part.shape[2] : width_] = part[0]
    return out


def pad_columns_left(cache: BufferCache, n: int) -> None:
    """In place: add n zero columns on the left of every layer."""
    if n <= 0:
        return
    for layer in cache.layers:
        if layer.is_initialized:
            width_ = layer.width + n
            keys = _room(torch.nn.functional.pad(layer.keys[:, :, : layer.width], (0, 0, n, 0)), width_ + RESERVE)
            values = _room(torch.nn.functional.pad(layer.values[:, :, : layer.width], (0, 0, n, 0)), width_ + RESERVE)
            layer.hold(keys, values, width_)


# --- the ragged layout's per-row slots ---------------------------------------------------------


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


def _write(slab: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> None:
    """slab.scatter_(2, index, new); 16-bit floats as int16, the same bits: CPU kernels scatter
    bfloat16 element by element, 4-19x slower than int16 (experiments/copy_ops.py)."""
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
                _write(part, idx, new if rows is None else new.index_select(0, rows))
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
