"""The only code that knows transformers' `Cache` classes: every KV cache batchspec uses.

- `BufferCache` (padded layouts: EQSPEC, EXSPEC's stacks, static batches): layers keep keys and
  values in preallocated buffers [B, H_kv, capacity, D]; columns [0, width) are the cache. A
  forward writes its new columns in place (the buffer doubles when full), so feeding a token costs
  no copy of the cache; transformers' `DynamicCache` concatenates, i.e. copies every layer's whole
  cache on every forward. Each function that moves entries (gather, stack) writes into a fresh
  buffer with `RESERVE` spare columns, enough for one speculative step without growing.
- `PagedCache` (the `ragged` layout) keeps every row's entries in one pool of fixed-size blocks
  per layer, allocated as rows grow; before each forward the batch says which rows run and where
  each writes. Entries never move; a retired row's blocks are freed.
- `reference_cache` is transformers' own `DynamicCache`, for the oracle and the invariant checker:
  they must not share this module's buffer code, so a bug here cannot hide in both.

Which columns are real and which are padding is not the cache's business: the caller (a padded
batch, a per-sequence store, the ragged batch) keeps that. `SeqKV` is one sequence's share: a
list over layers of (keys, values) [1, H_kv, n, D] holding its n real entries, oldest first.

Only full-attention models are supported (`models.check_supported` refuses the rest).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

SeqKV = list[tuple[torch.Tensor, torch.Tensor]]
RESERVE = 32  # spare columns allocated past the width whenever entries are moved
BLOCK = 16  # tokens per block of the paged pool


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


def reference_cache(config) -> DynamicCache:
    """transformers' plain growing cache (the oracle's; independent of this module's buffers)."""
    return DynamicCache(config=config)


def unsupported_layers(config) -> set[str]:
    """Names of the cache layer types this config needs that are not plain full attention
    (sliding windows, recurrent state); empty when the model is supported."""
    return {type(layer).__name__ for layer in DynamicCache(config=config).layers if type(layer) is not DynamicLayer}


def count(layers: SeqKV) -> int:
    """Entries held by one sequence's share."""
    return layers[0][0].shape[2] if layers else 0


def width(cache: Cache) -> int:
    """Number of columns (the same for every layer and row)."""
    return cache.get_seq_length()


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


# --- the ragged layout's paged pool --------------------------------------------------------------


class PagedLayer(CacheLayerMixin):
    """One layer's pools [tokens, H_kv, D]; `update` writes the new entries at the cache's write
    index, then gathers every running row's slots [0, span) for attention."""

    is_sliding = False

    def __init__(self, owner: PagedCache, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner, self.keys, self.values = owner, keys, values
        self.is_initialized, self.device = True, keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # pools exist from the start
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states [n, H, q, D] -> keys/values [n, H, span, D] of the forward's rows."""
        write, read = self.owner.write_index.reshape(-1), self.owner.read_index  # [n*q], [n, span]
        n, span = read.shape
        heads, dim = key_states.shape[1], key_states.shape[3]
        out = []
        for pool, states in ((self.keys, key_states), (self.values, value_states)):
            pool.index_copy_(0, write, states.transpose(1, 2).reshape(-1, heads, dim))
            out.append(pool.index_select(0, read.reshape(-1)).view(n, span, heads, dim).transpose(1, 2))
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.read_index.shape[1], 0

    def get_seq_length(self) -> int:
        return self.owner.read_index.shape[1]

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """KV entries of many rows in one pool of fixed-size blocks per layer, [tokens, H_kv, D].

    Row r owns the blocks `tables[r]`; its slot j lives at pool token `tables[r][j // B] * B + j % B`
    (B = `block_size`). Blocks are allocated as rows grow and freed when they leave, so the memory
    held follows the tokens held; the pool itself grows (doubling) up to `max_tokens` and never
    moves a row. Before each forward, `prepare` says which rows run and where their q new entries
    go; attention then reads each row's slots [0, span) gathered from the pool (slots past a
    row's own length read some block's finite entries and are masked out)."""

    def __init__(self, config, dtype: torch.dtype, device, max_tokens: int, block_size: int = BLOCK):
        self.heads = config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.max_blocks = -(-max_tokens // block_size)
        blocks = min(self.max_blocks, 8)
        super().__init__(
            layers=[PagedLayer(self, self._zeros(blocks), self._zeros(blocks)) for _ in range(config.num_hidden_layers)]
        )
        self.free_blocks: list[int] = list(range(blocks))
        self.tables: list[list[int]] = []
        self.write_index = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.read_index = torch.zeros(0, 0, dtype=torch.long, device=device)

    def _zeros(self, blocks: int) -> torch.Tensor:
        return torch.zeros(blocks * self.block_size, self.heads, self.dim, dtype=self.dtype, device=self.device)

    @property
    def blocks(self) -> int:
        """Blocks the pool holds now (in use or free)."""
        return self.layers[0].keys.shape[0] // self.block_size

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.heads * self.dim * self.layers[0].keys.element_size()

    def _grow(self, need: int) -> None:
        """Make room for `need` more free blocks (the pool doubles, up to max_blocks)."""
        old = self.blocks
        new = min(self.max_blocks, max(2 * old, old + need - len(self.free_blocks)))
        assert new - old + len(self.free_blocks) >= need, "KV pool exhausted: admission must reserve first"
        for layer in self.layers:
            layer.keys = torch.cat([layer.keys, self._zeros(new - old)])
            layer.values = torch.cat([layer.values, self._zeros(new - old)])
        self.free_blocks += range(old, new)

    def ensure(self, row: int, slots: int) -> None:
        """Give `row` blocks for slots [0, slots)."""
        while len(self.tables) <= row:
            self.tables.append([])
        need = -(-slots // self.block_size) - len(self.tables[row])
        if need > 0:
            if need > len(self.free_blocks):
                self._grow(need)
            self.tables[row] += [self.free_blocks.pop() for _ in range(need)]

    def release(self, row: int) -> None:
        """Free `row`'s blocks; the row's table becomes empty."""
        self.free_blocks += self.tables[row]
        self.tables[row] = []

    def move_table(self, src: int, dst: int) -> None:
        """Row `dst` takes over row `src`'s blocks (no entry is copied); `src` becomes empty."""
        self.tables[dst], self.tables[src] = self.tables[src], []

    def slot_index(self, rows: list[int], span: int) -> torch.Tensor:
        """Pool token index [len(rows), span] of slots 0..span-1 of each row (unowned: block 0)."""
        width = -(-span // self.block_size)
        table = torch.tensor([(self.tables[r] + [0] * width)[:width] for r in rows], dtype=torch.long)
        slots = torch.arange(span)
        index = table[:, slots // self.block_size] * self.block_size + slots % self.block_size
        return index.to(self.device)

    def prepare(self, rows: list[int], positions: torch.Tensor) -> None:
        """Before a forward of q new entries for each of `rows`, at slots positions [n, q]."""
        ends = (positions[:, -1] + 1).tolist()
        for row, end in zip(rows, ends):
            self.ensure(row, end)
        self.read_index = self.slot_index(rows, max(ends))
        self.write_index = self.read_index.gather(1, positions)

    def install(self, row: int, entries: SeqKV) -> None:
        """Write one sequence's real entries (oldest first) into slots 0.. of `row`."""
        count_ = count(entries)
        self.ensure(row, count_)
        index = self.slot_index([row], count_)[0]
        for layer, (k, v) in zip(self.layers, entries, strict=True):
            layer.keys.index_copy_(0, index, k[0].transpose(0, 1))
            layer.values.index_copy_(0, index, v[0].transpose(0, 1))

    def row(self, row: int, count_: int) -> SeqKV:
        """Row `row`'s first `count_` entries of every layer, [1, H, count_, D] each (copies)."""
        index = self.slot_index([row], count_)[0]
        return [
            (
                layer.keys.index_select(0, index).transpose(0, 1)[None],
                layer.values.index_select(0, index).transpose(0, 1)[None],
            )
            for layer in self.layers
        ]
