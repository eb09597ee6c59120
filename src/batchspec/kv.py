"""The only code that reads or writes transformers' Cache objects.

Layout: a `DynamicCache` whose layers hold keys/values [B, H_kv, W, D]; `W` is the cache width.
Which columns are real and which are padding is not the cache's business: the caller (a padded
batch, a per-sequence store) keeps that. `SeqKV` is one sequence's share: a list over layers of
(keys, values) [1, H_kv, n, D] holding its n real entries, oldest first.

Only full-attention `DynamicLayer`s are supported (`models.check_supported` refuses the rest).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

SeqKV = list[tuple[torch.Tensor, torch.Tensor]]


def empty(config) -> DynamicCache:
    """A cache with no entries for a model with this config."""
    return DynamicCache(config=config)


def width(cache: DynamicCache) -> int:
    """Number of columns (the same for every layer and row)."""
    return cache.get_seq_length()


def tensors(cache: DynamicCache) -> SeqKV:
    """Every layer's (keys, values); empty caches give []."""
    return [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]


def from_tensors(config, layers: SeqKV) -> DynamicCache:
    """A cache holding exactly these per-layer tensors (no copy)."""
    cache = DynamicCache(config=config)
    if layers:
        for layer, (keys, values) in zip(cache.layers, layers, strict=True):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
    return cache


def gather(cache: DynamicCache, rows: torch.Tensor, index: torch.Tensor, full_batch: bool) -> None:
    """In place: new[b, :, j] = old[rows[b], :, index[b, j]] for every layer (one gather each).

    index [B', W]; `full_batch` says rows is arange(B) (skips the row selection).
    """
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        keys = layer.keys if full_batch else layer.keys.index_select(0, rows)
        values = layer.values if full_batch else layer.values.index_select(0, rows)
        idx = index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        layer.keys = keys.gather(2, idx)
        layer.values = values.gather(2, idx)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """In place: keep only `rows` of the batch."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def split(cache: DynamicCache, starts: list[int]) -> list[SeqKV]:
    """Row b's entries from column starts[b] to the end, as views (no copy)."""
    layers = tensors(cache)
    return [[(k[b : b + 1, :, s:], v[b : b + 1, :, s:]) for k, v in layers] for b, s in enumerate(starts)]


def stack(config, seqs: list[SeqKV], take: list[int]) -> DynamicCache:
    """Left-padded batch cache from per-sequence entries: row b gets the first take[b] entries of
    seqs[b], right-aligned in width max(take); pad slots are zero (finite, masked out).

    Sequences that all contribute the same number of entries are concatenated without padding.
    """
    width_ = max(take) if take else 0
    if width_ == 0 or not seqs[0]:
        return empty(config)
    layers = []
    for layer in range(len(seqs[0])):
        parts_k = [s[layer][0][:, :, :n] for s, n in zip(seqs, take)]
        parts_v = [s[layer][1][:, :, :n] for s, n in zip(seqs, take)]
        layers.append((_left_pad_cat(parts_k, width_), _left_pad_cat(parts_v, width_)))
    return from_tensors(config, layers)


def _left_pad_cat(parts: list[torch.Tensor], width_: int) -> torch.Tensor:
    """[1, H, n_b, D] pieces -> [B, H, width, D], each right-aligned."""
    if all(p.shape[2] == width_ for p in parts):
        return torch.cat(parts, dim=0)
    head = parts[0]
    out = head.new_zeros(len(parts), head.shape[1], width_, head.shape[3])
    for b, part in enumerate(parts):
        if part.shape[2]:
            out[b, :, width_ - part.shape[2] :] = part[0]
    return out


def pad_columns_left(cache: DynamicCache, n: int) -> None:
    """In place: add n zero columns on the left of every layer."""
    if n <= 0:
        return
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, n, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, n, 0))
