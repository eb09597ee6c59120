"""The batch-invariant mode: a row's logits do not depend on what shares its forward.

Greedy speculative decoding is exact only if the target's logits for a token are the same bits
whether it was computed alone (plain decoding: one row, one query) or inside a verification (B rows,
k + 1 queries each, a tree's columns, a prefill chunk). In float32 and bfloat16 the usual kernels
break this: BLAS picks its path by matrix shape, and attention reduces over whatever span and
padding the batch has. Under this mode (`install(model)`) every reduction in the target's forward
is made independent of the batch, by construction:

- **Linear layers and the LM head** take oneDNN's matmul over a packed weight for every row count,
  one row padded to LINEAR_MIN_ROWS (`linear_form`, linears.FormTable.fixed): from 2 rows on its
  per-row result does not depend on M (measured for M = 2 .. 2,100, K up to 8,192, float32 and
  bfloat16, on an AMD EPYC); one row takes a matrix-vector path that differs once K >= 1,536.
  `F.linear` differs more (float32 at every M < 4, bfloat16 at K = 1,536). On CPUs with AMX,
  bfloat16 rows above 32 take tiles that reduce in another order, so 16-bit products go in blocks
  of at most LINEAR_MAX_ROWS rows.
- **Attention** (`attention`) reduces each query over its keys in *canonical order*: the keys it
  attends, numbered 0, 1, 2, .. by absolute position (padding, holes and a tree's other branches
  removed; a `Plan` per forward says where each rank is). Scores come from one batched matmul per
  key set, its rows padded to MIN_ROWS and its keys a multiple of BLOCK: shapes at which float32
  MKL gives an entry the same bits for any row or column count (it changes path below 4 rows and
  12 columns). The weighted values and the softmax's denominator are summed per BLOCK of ranks
  (matmuls of fixed shape; a reduction of fixed length), then the blocks in order by a sequential
  scan (`cumsum`, float64 accumulation). A masked key weighs an exact zero, a block past a query's
  last key adds exact zeros, so the sum is the same for any span, layout or batch. Everything is
  computed in float32 (bfloat16 inputs are exact in it); the output is rounded to the model's dtype.
  The KV entries are kept in float32 (`kv_dtype`, the same values), so that attention reads the
  ragged layout's slabs in place, each size class over its own span, with no converting copy.
- **Rotary embeddings** come from a table computed once per model (`_RotaryTable`): cos/sin of the
  same position are the same bits whatever the batch (vectorized and scalar cos differ).
- Norms, activations, residuals and the embedding are row-local already (tests/test_invariant.py
  checks each op the mode relies on, bitwise, alone vs. in batches).

The reference decoder runs the same model, so it runs under the mode too and stays the oracle.
CPU only: on other devices `install` refuses (docs/batch-invariance.md says how it maps to a GPU).
"""

from __future__ import annotations

import math
import types
import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..cache import kv, slots
from ..core.errors import BatchspecError
from ..distributed import tp
from . import attention as plain_attention
from .linears import FormTable, TunedLinear

NAME = "batchspec_invariant"
#: Keys per block of the attention's reduction, at canonical ranks 0, BLOCK, 2 BLOCK, ..
BLOCK = 64
#: Fewest rows a matmul of the mode is given (padded with zeros): below 4, float32 MKL takes other paths.
MIN_ROWS = 4
#: Query tokens attended together in a chain or prefill chunk (each group over the keys it reaches).
QUERY_GROUP = 64
#: Fewest rows the mode's linear layers multiply (padded with zeros): one row takes another path.
LINEAR_MIN_ROWS = 4
#: Most rows the mode's linear layers multiply at once in bfloat16 and float16 (more go in blocks):
#: on CPUs with AMX (Intel Xeon from Sapphire Rapids on) oneDNN multiplies more rows in tiles that
#: reduce in another order (a [1536 -> 576] bfloat16 weight: row 0 of 33 differs from row 0 alone,
#: while every count up to 32 agrees; tests/test_invariant.py).
LINEAR_MAX_ROWS = 32


#: Why the mode refuses tensor parallelism (here, and in the command line before ranks start).
NO_TP = "--batch-invariant does not run with --tp: the all-reduce order would vary"


def apply(model: torch.nn.Module, mode: bool | None) -> None:
    """Put `model` under the mode (True), take it out (False) or leave it (None), as an
    EngineConfig's `batch_invariant` says."""
    if mode and tp.active():
        raise BatchspecError(NO_TP)
    if mode is not None:
        (install if mode else uninstall)(model)


def installed(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Put `model` (a transformers decoder on a CPU, its linear layers tuned by linears.py) under the
    mode; raises BatchspecError where the mode cannot run."""
    if installed(model):
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise BatchspecError(
            f"--batch-invariant runs on CPUs only (the model is on {device}); see docs/batch-invariance.md"
        )
    if kv.has_sliding_layers(model.config):
        raise BatchspecError(
            f"--batch-invariant does not support sliding-window attention yet (the {model.config.model_type} "
            "model has sliding layers); run without it (float32 for the closest tokens)"
        )
    tables = {id(m.table): m.table for m in model.modules() if isinstance(m, TunedLinear)}
    if not tables or any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise BatchspecError("--batch-invariant needs the model's linear layers tuned (models.linears.tune_linears)")
    for table in tables.values():
        _check_onednn(table)
        table.fixed = linear_form(table)
    rotary = _rotary(model)
    rotary.forward = types.MethodType(_RotaryTable(rotary).forward, rotary)
    model.kv_dtype = torch.float32  # kv.entry_dtype: attention reads float32 entries in place
    model.__dict__["_batchspec_plain_attention"] = model.config._attn_implementation
    model.config._attn_implementation = NAME
    return model


def uninstall(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `install` (plain kernels again)."""
    if not installed(model):
        return model
    for m in model.modules():
        if isinstance(m, TunedLinear):
            m.table.fixed = None
    rotary = _rotary(model)
    del rotary.forward  # the class's method again
    del model.kv_dtype
    model.config._attn_implementation = model.__dict__.pop("_batchspec_plain_attention", plain_attention.NAME)
    return model


def linear_form(table: FormTable):
    """The mode's linear formulation: x [M, I], weight [O, I], bias -> [M, O] by `table`'s oneDNN
    matmul, M padded to at least LINEAR_MIN_ROWS; in 16-bit types, in blocks of at most
    LINEAR_MAX_ROWS rows."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows > LINEAR_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            return torch.cat([linear(block, weight, bias) for block in x.split(LINEAR_MAX_ROWS)])
        padded = _rows(x, LINEAR_MIN_ROWS)
        out = table.onednn(padded, weight, bias)
        return out if padded is x else out[:rows]

    return linear


def _check_onednn(table: FormTable) -> None:
    layer = table.layers[0]
    try:
        table.onednn(torch.zeros(1, layer.in_features, dtype=layer.weight.dtype), layer.weight, None)
    except (RuntimeError, NotImplementedError) as e:
        raise BatchspecError(
            f"--batch-invariant needs oneDNN's matmul in {layer.weight.dtype} on this CPU, which fails: {e}"
        ) from e


def _rotary(model: torch.nn.Module) -> torch.nn.Module:
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", "default")
    if rotary is None or rope_type not in ("default", "llama3", "linear"):
        raise BatchspecError(
            f"--batch-invariant supports static rotary embeddings (default, llama3, linear), not {rope_type!r}"
        )
    return rotary


class _RotaryTable:
    """cos/sin [B, q, D] of position ids [B, q], looked up in tables [P, D] made once (float32, in
    fixed chunks of BLOCK positions, so a position's row never depends on how many were made)."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = weakref.ref(rotary)
        self.cos = self.sin = None

    def _grow(self, positions: int) -> None:
        rotary = self.rotary()
        have = 0 if self.cos is None else self.cos.shape[0]
        need = BLOCK * math.ceil(max(positions, 1) / BLOCK)
        if need <= have:
            return
        inv = rotary.inv_freq.float()
        chunks_cos, chunks_sin = [], []
        for start in range(have, need, BLOCK):
            freqs = torch.arange(start, start + BLOCK, dtype=torch.float)[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            chunks_cos.append(emb.cos() * rotary.attention_scaling)
            chunks_sin.append(emb.sin() * rotary.attention_scaling)
        self.cos = torch.cat([t for t in (self.cos, *chunks_cos) if t is not None])
        self.sin = torch.cat([t for t in (self.sin, *chunks_sin) if t is not None])

    def forward(self, _module, x: torch.Tensor, position_ids: torch.Tensor):
        self._grow(int(position_ids.max()) + 1)
        index = position_ids.to(torch.long).cpu()
        return self.cos[index].to(x.device, x.dtype), self.sin[index].to(x.device, x.dtype)


def attended(mask: torch.Tensor | None, batch: int, q: int, keys: int) -> torch.Tensor:
    """transformers' mask [B, 1, q, >= keys] (bool: True attends; float: 0 attends) or None (causal
    over the cache: the q queries are its last q positions) -> bool [B, q, keys]."""
    if mask is None:
        cols = torch.arange(keys)
        return (cols[None, :] <= cols[keys - q :, None]).expand(batch, q, keys)
    if mask.shape[1] != 1:
        raise BatchspecError("--batch-invariant: per-head attention masks are not supported")
    mask = mask[:, 0, :, :keys]
    return mask if mask.dtype == torch.bool else mask == 0


class Plan:
    """Where each query's canonical keys are, for one forward (every layer shares it).

    union: every key some query of the row attends, in buffer order: `uidx` [B, NU] (NU a multiple
    of BLOCK; 0 past the row's count); `aligned` when rank r is at slot r in every row, else `runs`:
    (first slot, count) per row when each row's union is one run of slots (left padding), or None.
    `uvalid` [B, q, NU]: query i attends union rank r (r below its count when its keys are the
    union's first ones, else below its count rounded down to a BLOCK: the rest of its keys then come
    from its tail). `groups`: (query columns, union ranks they reach, a multiple of BLOCK) per
    QUERY_GROUP columns. tail (a tree's branches): `tidx`, `tvalid` [B, q, NT]: query i's canonical
    ranks from that block boundary on, or None."""

    def __init__(self, att: torch.Tensor):
        b, q, keys = att.shape
        union = att.any(1)  # [B, L]
        count_u = union.sum(-1)
        nu = BLOCK * max(1, math.ceil(int(count_u.max()) / BLOCK))
        self.uidx = _positions(union, nu)  # [B, NU]
        ranks = torch.arange(nu)
        self.aligned = bool(((self.uidx == ranks) | (ranks >= count_u[:, None])).all())  # rank r at slot r
        first = self.uidx[:, :1]
        runs = bool(((self.uidx == first + ranks) | (ranks >= count_u[:, None])).all())  # rank r at slot s_b + r
        self.runs = list(zip(first[:, 0].tolist(), count_u.tolist())) if runs and not self.aligned else None
        seen = att.gather(2, self.uidx[:, None, :].expand(b, q, nu)) & (ranks < count_u[:, None])[:, None, :]
        count = att.sum(-1)  # [B, q]
        lead = seen.long().cumprod(-1).sum(-1)  # the union's first keys query i attends
        whole = lead == count
        limit = torch.where(whole, count, lead // BLOCK * BLOCK)
        self.uvalid = ranks < limit[..., None]  # [B, q, NU]
        # query tokens in groups of QUERY_GROUP, each with the union ranks its queries reach
        reach = limit.amax(0).tolist()  # [q]
        self.groups = [
            (slice(c, c + QUERY_GROUP), BLOCK * max(1, math.ceil(max(reach[c : c + QUERY_GROUP]) / BLOCK)))
            for c in range(0, q, QUERY_GROUP)
        ]
        self.tidx = self.tvalid = None
        if not bool(whole.all()):
            rest = torch.where(whole, 0, count - limit)
            nt = BLOCK * math.ceil(int(rest.max()) / BLOCK)
            own = _positions(att.reshape(b * q, keys), keys).view(b, q, keys)  # query i's r-th key
            offs = limit[..., None] + torch.arange(nt)  # canonical ranks of the tail
            self.tvalid = (offs < count[..., None]) & ~whole[..., None]
            self.tidx = own.gather(2, offs.clamp(max=keys - 1)).masked_fill(~self.tvalid, 0)


def _positions(keep: torch.Tensor, width: int) -> torch.Tensor:
    """keep [N, L] bool -> [N, width] long: the positions where keep is True, in order, then 0s."""
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    order = order.masked_fill(~keep.gather(1, order), 0)
    if width > keep.shape[1]:
        order = torch.nn.functional.pad(order, (0, width - keep.shape[1]))
    return order[:, :width]


_plans: dict = {"mask": None}  # the current forward's mask (a weakref, or None) and its Plans by part


def plan_for(mask: torch.Tensor | None, batch: int, q: int, keys: int, part=None) -> Plan:
    """The Plan of `mask` [B, 1, q, >= keys], or of rows `part` [m] of it (made by the forward's
    first layer, reused by the others)."""
    ref = _plans["mask"]
    same = (mask is None and ref is None) or (mask is not None and ref is not None and ref() is mask)
    if not same:
        _plans.clear()
        _plans["mask"] = None if mask is None else weakref.ref(mask)
    key = (batch, q, keys, None if part is None else tuple(part.tolist()))
    if key not in _plans:
        rows = mask if mask is None or part is None else mask.index_select(0, part)
        _plans[key] = Plan(attended(rows, batch, q, keys))
    return _plans[key]


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [..., R, X] -> [..., max(R, rows), X], zero rows added (only those are filled)."""
    extra = rows - t.shape[-2]
    if extra <= 0:
        return t
    out = t.new_empty(*t.shape[:-2], rows, t.shape[-1])
    out[..., : t.shape[-2], :] = t
    out[..., t.shape[-2] :, :] = 0
    return out


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [N, r, D], k [N, S, D] (S a multiple of BLOCK) -> scores q k^T [N, r, S] in float32. One
    product per key set, rows padded to MIN_ROWS: a score's bits depend on neither the row count
    nor S (>= 12) (measured)."""
    return torch.bmm(_rows(q, MIN_ROWS), k.transpose(1, 2))[:, : q.shape[1]]


def _partials(e: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """e [N, r, S] (softmax numerators, 0 where masked), v [N, S, D] -> each BLOCK's sum of e v
    [N, S / BLOCK, r, D], by products of fixed shape [MIN_ROWS+, BLOCK] x [BLOCK, D]."""
    n, r, s = e.shape
    nb, dim = s // BLOCK, v.shape[-1]
    blocks = _rows(e.view(n, r, nb, BLOCK).transpose(1, 2), MIN_ROWS)  # [N, nb, R, BLOCK]
    rows = blocks.shape[2]
    out = torch.bmm(blocks.reshape(n * nb, rows, BLOCK), v.reshape(n * nb, BLOCK, dim))
    return out.view(n, nb, rows, dim)[:, :, :r]


def _block_sums(e: torch.Tensor) -> torch.Tensor:
    """e [N, r, S] -> each BLOCK's sum [N, r, S / BLOCK] (a reduction of fixed length)."""
    return e.view(*e.shape[:-1], e.shape[-1] // BLOCK, BLOCK).sum(-1)


def _union(t: torch.Tensor, plan: Plan) -> torch.Tensor:
    """t [B, H_kv, L, D] -> float32 [B, H_kv, NU, D]: the union's keys (or values) by rank. Where
    the buffer already holds rank r at slot r, read in place (widened to NU columns where the
    buffer behind the view has them: columns past a row's keys are masked, so whatever they hold
    weighs an exact zero; a view where float32, else one converting copy); otherwise gathered."""
    nu = plan.uidx.shape[1]
    if plan.runs is not None:  # a padded layout's rows: one converting copy of each row's run
        out = t.new_empty(*t.shape[:2], nu, t.shape[3], dtype=torch.float32)
        for b, (first, count) in enumerate(plan.runs):
            out[b, :, :count] = t[b, :, first : first + count]
            out[b, :, count:] = 0
        return out
    if not plan.aligned:
        return _gather(t, plan.uidx)
    if t.shape[2] < nu and _room(t, nu):
        t = t.as_strided((*t.shape[:2], nu, t.shape[3]), t.stride())
    if t.shape[2] >= nu:
        return t[:, :, :nu].float()
    out = t.new_empty(*t.shape[:2], nu, t.shape[3], dtype=torch.float32)
    out[:, :, : t.shape[2]] = t
    out[:, :, t.shape[2] :] = 0
    return out


def _room(t: torch.Tensor, columns: int) -> bool:
    """Whether view t [B, H, L, D] (a cache buffer's first L of its columns) can be widened to
    `columns` within its buffer: rows of D contiguous entries, each (b, h) with room for them."""
    b, h, _, d = t.shape
    if t.stride(3) != 1 or t.stride(2) != d or t.stride(1) < columns * d or t.stride(0) < h * t.stride(1):
        return False
    last = t.storage_offset() + (b - 1) * t.stride(0) + (h - 1) * t.stride(1) + columns * d
    return last <= t.untyped_storage().nbytes() // t.element_size()


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, H, L, D], index [B, ..., N] -> float32 [B, ..., H, N, D]: t[b, :, index[b, ...]]
    (indexing copies rows of D entries: 2x faster here than `torch.gather`, element by element)."""
    b = t.shape[0]
    rows = torch.arange(b).view(b, *([1] * (index.dim() - 1)))
    picked = t[rows, :, index]  # [B, ..., N, H, D]
    return picked.movedim(-2, -3).float().contiguous()


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Plan, scaling: float) -> torch.Tensor:
    """query [B, H, q, D], key/value [B, H_kv, L, D] -> [B, q, H, D] in query's dtype, each query
    reduced over its canonical keys (module docstring). Chains and prefill chunks go in groups of
    QUERY_GROUP query tokens, each over the union's ranks its queries reach (a prefill's first
    queries skip the blocks only later ones read: those would add exact zeros)."""
    qf = query.float() * scaling
    ku, vu = _union(key, plan), _union(value, plan)  # [B, H_kv, NU, D]
    if plan.tidx is not None:
        tail = (_gather(key, plan.tidx), _gather(value, plan.tidx), plan.tvalid)
        out = _reduce(qf, ku, vu, plan.uvalid, tail)
    else:
        outs = [_reduce(qf[:, :, c], ku[:, :, :w], vu[:, :, :w], plan.uvalid[:, c, :w]) for c, w in plan.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).to(query.dtype)


def _reduce(qf: torch.Tensor, ku: torch.Tensor, vu: torch.Tensor, valid: torch.Tensor, tail=None) -> torch.Tensor:
    """qf [B, H, q, D] (scaled, float32), ku/vu [B, H_kv, S, D] (union ranks, float32), valid [B, q,
    S]; tail: (keys, values [B, q, H_kv, NT, D], valid [B, q, NT]) or None -> [B, H, q, D] float32:
    the softmax's maximum over all of a query's keys, its numerator and denominator per BLOCK, then
    the blocks in order (cumsum: float64 accumulation; masked keys and empty blocks add exact zeros)."""
    b, heads, q, dim = qf.shape
    kv_heads, nu = ku.shape[1], ku.shape[2]
    g = heads // kv_heads  # head h reads kv head h // g
    n, rows = b * kv_heads, g * q  # union: one key set per (row, kv head); its rows (head j, query i)
    su = _scores(qf.reshape(n, rows, dim), ku.reshape(n, nu, dim))
    su.view(b, kv_heads, g, q, nu).masked_fill_(~valid[:, None, None], float("-inf"))  # broadcast, no copy
    m = su.amax(-1)  # [N, g q]
    if tail is not None:  # a tree's branches: one key set per (row, query, kv head), its g heads
        kt, vt, valid_t = tail
        nt, sets = kt.shape[3], b * q * kv_heads
        qt = qf.view(b, kv_heads, g, q, dim).permute(0, 3, 1, 2, 4).reshape(sets, g, dim)
        st = _scores(qt, kt.reshape(sets, nt, dim))
        st.view(b, q, kv_heads, g, nt).masked_fill_(~valid_t[:, :, None, None], float("-inf"))
        to_union = lambda t: t.view(b, q, kv_heads, g, *t.shape[2:]).movedim(1, 3).reshape(n, rows, *t.shape[2:])  # noqa: E731
        m = torch.maximum(m, to_union(st.amax(-1)))
    m = torch.where(torch.isfinite(m), m, 0.0)[..., None]  # a query without keys: zeros out
    eu = torch.exp(su - m)  # masked: exp(-inf) = 0
    parts = _partials(eu, vu.reshape(n, nu, dim))  # [N, nbu, g q, D]
    sums = _block_sums(eu)  # [N, g q, nbu]
    if tail is not None:
        to_sets = lambda t: t.view(b, kv_heads, g, q, *t.shape[2:]).movedim(3, 1).reshape(sets, g, *t.shape[2:])  # noqa: E731
        et = torch.exp(st - to_sets(m))
        tail_parts = _partials(et, vt.reshape(sets, nt, dim))  # [sets, nbt, g, D]
        parts = torch.cat([parts, to_union(tail_parts.transpose(1, 2)).transpose(1, 2)], dim=1)
        sums = torch.cat([sums, to_union(_block_sums(et))], dim=-1)
    num = parts.cumsum(dim=1)[:, -1]  # [N, g q, D]
    den = sums.cumsum(dim=-1)[..., -1:]  # [N, g q, 1]
    out = num / den.clamp_min(torch.finfo(torch.float32).tiny)
    return out.view(b, heads, q, dim)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature, under the mode (see `attend`)."""
    unsupported = [n for n in ("softcap", "sliding_window", "position_bias") if kwargs.get(n) is not None]
    if unsupported or kwargs.get("output_attentions") or dropout:
        raise BatchspecError(f"--batch-invariant does not support attention with {unsupported or 'dropout'}")
    b, heads, q, dim = query.shape
    scaling = dim**-0.5 if scaling is None else scaling
    if not isinstance(key, slots.RowParts):
        return attend(query, key, value, plan_for(attention_mask, b, q, key.shape[2]), scaling).contiguous(), None
    out = query.new_empty(b, q, heads, dim)  # the ragged layout's size classes: each over its own slab
    for (rows, k), (_, v) in zip(key.parts, value.parts):
        plan = plan_for(attention_mask, rows.shape[0], q, k.shape[2], rows)
        out.index_copy_(0, rows, attend(query.index_select(0, rows), k, v, plan, scaling))
    return out, None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
