"""With slots.py, the only code that knows transformers' `Cache` classes: every KV cache batchspec uses.

- `BufferCache` (padded layouts: EQSPEC, EXSPEC's stacks, static batches): layers keep keys and
  values in preallocated buffers [B, H_kv, capacity, D]; columns [0, width) are the cache. A
  forward writes its new columns in place (the buffer doubles when full), so feeding a token costs
  no copy of the cache; transformers' `DynamicCache` concatenates, i.e. copies every layer's whole
  cache on every forward. Each function that moves entries (gather, stack) writes into a fresh
  buffer with `RESERVE` spare columns, enough for one speculative step without growing.
- `SlotCache` (the `ragged` layout) is in slots.py.
- `reference_cache` is transformers' own `DynamicCache`, for the oracle and the invariant checker:
  they must not share this module's buffer code, so a bug here cannot hide in both.

Which columns are real and which are padding is not the cache's business: the caller (a padded
batch, a per-sequence store, the ragged batch) keeps that. `SeqKV` is one sequence's share: a
list over layers of (keys, values) [1, H_kv, n, D] holding its n real entries, oldest first.

Full-attention layers and sliding-window ones are supported (`models.support` refuses
the rest): a sliding layer keeps every entry here too, and attention cuts its mask to the window
(`attention.windowed`), so moving columns means the same for both. H_kv is the
heads this process holds: under tensor parallelism (tp.py) a rank holds its share (`kv_heads`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

SeqKV = list[tuple[torch.Tensor, torch.Tensor]]
RESERVE = 32  # spare columns allocated past the width whenever entries are moved


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


def copy_into(dst: BufferCache, src: BufferCache, dtype: torch.dtype) -> None:
    """`dst` (a model of `src`'s layers and heads) holds a copy of `src`'s columns, in `dtype`."""
    for to, layer in zip(dst.layers, src.layers, strict=True):
        if layer.is_initialized:
            to.hold(layer.keys.to(dtype, copy=True), layer.values.to(dtype, copy=True), layer.width)


def empty_caches(models: dict) -> dict[str, BufferCache]:
    """An empty cache for each role's model: {role: model} -> {role: cache}."""
    return {role: empty(model.config) for role, model in models.items()}


def reference_cache(config, full: bool = False) -> DynamicCache:
    """transformers' plain growing cache (the oracle's; independent of this module's buffers): its
    sliding layers keep only their window, unless `full` (every layer keeps every entry, as here;
    transformers still masks the window)."""
    return DynamicCache() if full else DynamicCache(config=config)


#: transformers' cache layers whose attention batchspec's caches reproduce (full and sliding window).
SUPPORTED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def unsupported_layers(config) -> set[str]:
    """Names of the cache layer types this config needs that are neither full attention nor a
    sliding window (recurrent or linear-attention state, chunked attention, ...); empty when the
    model is supported."""
    try:
        layers = DynamicCache(config=config).layers
    except (KeyError, ValueError) as err:  # a layer kind transformers' caches do not know
        return {f"unknown ({err})"}
    return {type(layer).__name__ for layer in layers if type(layer) not in SUPPORTED_LAYERS}


def has_sliding_layers(config) -> bool:
    """Whether some layer of this config attends over a sliding window."""
    return any(type(layer) is DynamicSlidingWindowLayer for layer in DynamicCache(config=config).layers)


def entry_dtype(model) -> torch.dtype:
    """The dtype of `model`'s KV entries: `kv_dtype` where set (the batch-invariant mode keeps float32
    entries), else its own layers' (`model.dtype` where a draft or head tied to a target's embedding
    in another precision says so, or `compute_dtype` (quant.self_draft); transformers' models report
    their first floating parameter's)."""
    own = getattr(model, "kv_dtype", None) or getattr(model, "compute_dtype", None) or getattr(model, "dtype", None)
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
            out[:, :, width_:].zero_()  # never garbage: attention may read (and mask) past the width
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
    full = next((s for s in seqs if s), None)
    if width_ == 0 or full is None:
        return cache
    # A sequence that holds nothing yet (a drafter never fed it) contributes nothing: take 0.
    seqs = [s or [(k[:, :, :0], v[:, :, :0]) for k, v in full] for s in seqs]
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
