"""A compiled decoder: the layers' elementwise math fused into one graph around the products and
attention, which stay the engine's own.

transformers' decoder runs about 80 operations a layer; at one row on a CPU their fixed costs
(dispatch, allocation, Python) are a third of a forward. Lean layers (lean.py) bring that to about
20; `CompiledDecoder` runs them as one `torch.compile`d (inductor) function of (token ids, cos,
sin) -> hidden states, in which everything but two kinds of operation is fused C++:

- `batchspec::product`: a linear layer of the model, computed as the layer itself computes it (a
  `TunedLinear`'s measured fastest formulation for the row count, or the batch-invariant form).
  oneDNN's packed weights are opaque to the compiler, and the formulations are chosen per row
  count, so the products are called, not traced.
- `batchspec::attend`: write the new keys and values into whatever cache the forward was given
  (ragged slots, a padded buffer, the reference's own) and attend with the model's attention
  function and the forward's mask, so layouts, masks, trees and row spans are unchanged. Over the
  ragged slots what is the same for every layer (the write index, each size class's mask) is
  planned once per forward (attention.Planned): the same operations, less Python a layer.

The graph sees the batch flattened to one row of N tokens ([1, N, W]): the dense math is per
token, and only `attend` needs the rows, which it reads from the forward. So one graph serves
every batch size and query width (N symbolic; N = 1 is a graph apart, so two graphs). Each graph
is compiled ahead of its first call and kept whole in the tuning cache (precompiled.py), so a later
start loads it without tracing; inductor's own cache (`cache_dir`) keeps the code of graphs compiled
lazily (the frozen-weights form, other backends, a saved graph that does not load).

`autotune` (`--max-autotune`): the products are traced instead, the weights frozen into the graph
as constants, and inductor generates and times its own C++ GEMM kernel per product shape (its CPP
template; faster than the library calls at a few rows). Each such graph is exported and compiled
ahead of time into a package kept in the tuning cache, keyed by the weights' digest, which a later
start loads without tracing (packaged.py); where that fails, torch.compile's frozen graph, whose
kernels inductor's cache keeps (`_plain_weight_packing`). A weight changed in place after is
refused, not read stale.

The engine never learns a compiler ran: `install` replaces the decoder's `forward`, with its
signature and result. A forward the graph does not serve runs the eager lean layers (the same
numerics but for the fused elementwise order): more than MAX_ROWS tokens (FROZEN_MAX_ROWS for a
frozen graph; a prompt's prefill, where the products dominate), gradients, embeddings given instead
of ids, the batch-invariant mode (its attention and rotary tables are the eager ones; see
docs/benchmarks.md). `reference` calls the same decoder, so the oracle and the methods share its
numerics. A model whose layers the lean form does not compute stays eager (`why_not`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import weakref

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..cache import kv
from ..core import diskcache
from ..core.errors import BatchspecError
from . import attention, lean, linears, packaged, precompiled
from .invariant import NAME as INVARIANT  # the batch-invariant mode's attention, which runs eager
from .quant import QuantLinear

#: The environment variable that turns the default off (pair.default_eager_reason), or asks for
#: `max-autotune` where `compile` was not given.
ENV = "BATCHSPEC_COMPILE"

#: Most tokens (rows x query width) a compiled forward takes; more run eager.
MAX_ROWS = 128
#: Most tokens a frozen graph's forward takes, a carried rider's included: its C++ GEMM kernels,
#: generic in the token count, were level with the eager products at 48 tokens and 1.05-1.36x their
#: time at 64-128 on the 2-core AVX2 machine of docs/benchmarks.md (short prompts' prefill).
FROZEN_MAX_ROWS = 48
#: `autotune`: inductor's own C++ GEMM kernels for the frozen weights, chosen among by timing
#: against ATen's (torch.compile's mode "max-autotune" on a CPU; the CPP template needs frozen weights),
#: without inductor's tables of the timings on stderr.
AUTOTUNE = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
#: The tuning cache's kind of record that a model's tuned packages were made (`tuned_cached`).
TUNED = "tuned"
#: $BATCHSPEC_COMPILE's value for the default graph even where tuned packages are cached.
GRAPH = "graph"
#: Graphs of LeanStack.forward a process may compile (torch's default, 8, is two or three pairs).
RECOMPILE_LIMIT = 64

#: slot -> a linear layer (weakly held), read by `product`; the current forward's segments (each a
#: cache, mask and rows) and its decoder's first slot, read by `attend` and `product` (set around
#: the graph call; a forward never re-enters itself). A graph holds its products' slots relative to
#: its decoder's first, so a graph kept on disk (precompiled.py) serves any process's copy of the model.
_PRODUCTS: dict[int, weakref.ref] = {}
_CURRENT: dict = {}


@torch.library.custom_op("batchspec::product", mutates_args=())
def product(x: torch.Tensor, slot: int) -> torch.Tensor:
    """x [.., I] -> [.., O] by the linear layer in `slot` (past the current decoder's first)."""
    return _PRODUCTS[_CURRENT["base"] + slot]()(x)


@product.register_fake
def _(x, slot):
    return x.new_empty(*x.shape[:-1], _PRODUCTS[_CURRENT["base"] + slot]().out_features)


@torch.library.custom_op("batchspec::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
    """query [1, H, N, D], key/value [1, H_kv, N, D] of layer `layer`, the current forward's tokens
    flattened -> [1, N, H * D]: each segment's (its B x q tokens: the batch's, then a rider's) new
    entries written to its own cache, and attention over that cache with its own mask (planned
    once for the forward where it can be: attention.Planned)."""
    module, outs, start = _CURRENT["modules"][layer], [], 0
    for cache, mask, (b, q), planned in _CURRENT["segments"]:
        part = (t[:, :, start : start + b * q] for t in (query, key, value))
        part = [t.reshape(t.shape[1], b, q, t.shape[3]).transpose(0, 1) for t in part]
        if planned is not None:
            out = planned(*part, layer, module.scaling, getattr(module, "sliding_window", None))
        else:
            out = lean.cached_attention(module, cache, mask, *part, layer)  # the window: attention._layer_window
        outs.append(out.reshape(1, b * q, -1))
        start += b * q
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


@attend.register_fake
def _(query, key, value, layer):
    _, heads, n, dim = query.shape
    return query.new_empty(1, n, heads * dim)


def env_setting() -> str:
    """$BATCHSPEC_COMPILE as given, trimmed and lower-cased ("" when unset)."""
    return os.environ.get(ENV, "").strip().lower()


def why_not(model: torch.nn.Module, tp_size: int = 1) -> str | None:
    """Why `model`'s decoder cannot be compiled (None: it can); before `lean.install`."""
    if tp_size > 1:
        return "a tensor-parallel shard keeps transformers' layers (their sharding hooks)"
    layers = model.get_decoder().layers
    kinds = {type(layer).__name__ for layer in layers if not lean.supported(layer)}
    if kinds:
        return f"its {', '.join(sorted(kinds))} layers are not of a lean form (Llama, Qwen or Gemma 3 layers)"
    return None


class LeanStack(torch.nn.Module):
    """The decoder's math over one row of N tokens: embedding, lean layers, the final norm.
    `form`: how the products are computed: None, each by its layer (`batchspec::product`); or the
    name of a traceable formulation (linears.py) for all of them, which the graph then contains."""

    def __init__(self, decoder: torch.nn.Module, form: str | None = None):
        super().__init__()
        self.embed = decoder.embed_tokens
        self.layers = decoder.layers  # lean.LeanLayer each
        self.norm = decoder.norm  # transformers' own final norm, as the eager decoder computes it
        self.form = form
        self.kinds = rope_kinds(decoder)
        self.tables = [self.kinds.index(layer.rope_kind) for layer in self.layers]  # each layer's cos/sin row

    def product(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        if isinstance(layer, QuantLinear):  # PyTorch's own weight-only kernels: traced, no call
            return layer(x)
        if self.form is None:
            return product(x, layer.batchspec_slot)  # a constant of the graph, the same in every process
        flat = x.reshape(-1, x.shape[-1])
        return linears.FUNCTIONS[self.form](flat, layer.weight, layer.bias).view(*x.shape[:-1], -1)

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids [1, N], cos/sin [K, N, D] (a RoPE table per kind, `rope_kinds`) -> (final hidden
        states [1, N, W], then each layer's output)."""
        hidden = self.embed(ids)
        outputs = []
        for layer, t in zip(self.layers, self.tables):
            hidden = layer.step(hidden, cos[t : t + 1], sin[t : t + 1], attend, self.product)
            outputs.append(hidden)
        return (self.norm(hidden), *outputs)


def rope_kinds(decoder: torch.nn.Module) -> list[str | None]:
    """The decoder's RoPE tables, by the layer kind each serves: [None] where every layer rotates
    alike, else each kind of its lean layers (Gemma 3: full and sliding layers, each a table)."""
    return sorted({layer.rope_kind for layer in decoder.layers}, key=str)


def rotary(decoder: torch.nn.Module, kinds, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos, sin [K, b, q, D] for positions [b, q]: the decoder's RoPE table of each of `kinds`
    (`rope_kinds`, which a LeanStack holds)."""
    tables = [
        decoder.rotary_emb(like, positions) if kind is None else decoder.rotary_emb(like, positions, kind)
        for kind in kinds
    ]
    return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])


class CompiledDecoder:
    """A transformers decoder's `forward` (lean layers), served by a compiled `LeanStack` where it can."""

    def __init__(
        self, decoder: torch.nn.Module, eager, backend: str = "inductor", freeze: bool = False, autotune: bool = False
    ):
        self.decoder, self.eager, self.backend = decoder, eager, backend
        self.freeze, self.autotune = freeze or autotune, autotune
        self.base = len(_PRODUCTS)
        for slot, linear in enumerate(_numbered(decoder)):
            _PRODUCTS[self.base + slot] = weakref.ref(linear)
        self.stack = LeanStack(decoder)
        self.modules = [layer.attn[0] for layer in decoder.layers]
        self.graphs: dict[tuple, object] = {}  # (product form, one token, inference mode) -> its compiled stack
        self.calls = 0  # forwards a graph served
        self.packages: list[packaged.Packaged] = []  # the frozen graphs' (packaged.py)
        self.rider = None  # a forward.Rider the next served forward carries (forward.carrying sets it)
        self.windows = kv.has_sliding_layers(decoder.config)  # some layer attends over a sliding window

    def graph(self, tokens: int):
        """The compiled stack for a forward of `tokens` tokens: at one token, products traced into
        the graph in the formulation the layers' table chose there, where that one is traceable
        (one row's products are where a call's fixed cost weighs most); else called."""
        table = getattr(self.stack.layers[0].qkv, "table", None)
        form = None
        if self.freeze:
            form = "plain"  # oneDNN-packed by inductor's freezing, at every row count
        elif tokens == 1 and table is not None and table.fixed is None:
            name = table.form_name(1)
            form = name if name in linears.FUNCTIONS else None
        one, mode = tokens == 1, torch.is_inference_mode_enabled()  # a graph's guards hold its inputs' mode
        if (form, one, mode) not in self.graphs:
            stack = LeanStack(self.decoder, form)
            options = self.options

            def lazy(stack=stack, options=options):
                return torch.compile(stack, backend=self.backend, dynamic=True, fullgraph=True, options=options)

            tag = self.weights_tag if self.freeze else None  # the digest of the weights `frozen` took
            if self.freeze and self.backend == "inductor":  # a package on disk, else inductor's cache
                _plain_weight_packing()
                found = packaged.Packaged(stack, one, tag, options, functools.partial(_frozen, lazy, tag))
                self.packages.append(found)
                self.graphs[form, one, mode] = _unchanged(found, *self.frozen)
            elif self.freeze:
                self.graphs[form, one, mode] = _unchanged(_frozen(lazy, tag), *self.frozen)
            elif self.backend == "inductor":
                self.graphs[form, one, mode] = precompiled.Graph(stack, one, self.backend, lazy)
            else:
                self.graphs[form, one, mode] = lazy()
        return self.graphs[form, one, mode]

    @property
    def options(self) -> dict | None:
        """inductor's options for this decoder's graphs (None: the defaults)."""
        return _frozen_options(self.autotune) if self.freeze else None

    def packaged(self) -> bool:
        """Whether both frozen graphs are packages in the tuning cache, which a start loads."""
        return self.freeze and _packages_cached(self.decoder, self.weights_tag, self.options)

    @functools.cached_property
    def frozen(self) -> tuple[list[torch.Tensor], list[int]]:
        """The decoder's weights (every graph's stack holds the same ones) and their versions, taken
        once, when they are first frozen: every frozen graph's call checks them (`_unchanged`)."""
        weights = list(self.stack.parameters())
        return weights, [None if w.is_inference() else w._version for w in weights]  # inference tensors: untracked

    @functools.cached_property
    def weights_tag(self) -> str:
        """The frozen graphs' cache key tag: a digest of the weights `frozen` took, so no graph
        ever freezes weights other than the ones the tag names."""
        weights, _ = self.frozen
        return _weights_tag(weights)

    @property
    def max_rows(self) -> int:
        """Most tokens this decoder's graphs take in a forward (more run eager)."""
        return FROZEN_MAX_ROWS if self.freeze else MAX_ROWS

    def serves(self, ids, inputs_embeds, kwargs) -> bool:
        return (
            ids is not None
            and inputs_embeds is None
            and ids.numel() <= self.max_rows
            and (ids.dtype == torch.long or not self.freeze)  # a package checks no inputs: those it was made for
            and not torch.is_grad_enabled()
            and self.decoder.config._attn_implementation != INVARIANT
            and not any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states"))
        )

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        if not self.serves(input_ids, inputs_embeds, kwargs) or (self.windows and _windowed_cache(cache, use_cache)):
            return self.eager(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        b, q = input_ids.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=self.decoder.config)
        if position_ids is None:  # transformers' decoder's rules, for its own callers
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + q, device=input_ids.device)[None]
        rider, self.rider = self.rider, None
        if rider is not None and self.freeze and b * q + rider.ids.numel() > self.max_rows:
            rider = None  # left to admission's `settle`, which feeds it after the step
        segments = [self._segment(input_ids, attention_mask, position_ids, cache)]
        if rider is not None:
            segments.append(self._segment(rider.ids, **rider.inputs))
        # A saved graph's guards hold its inputs' strides and dispatch keys: contiguous ones, made in
        # inference mode where it runs (a refused call is traced again: seconds).
        inference = torch.is_inference_mode_enabled()
        args = [torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*(s[4] for s in segments))]
        args = [
            t.contiguous() if t.is_inference() or not inference else t.clone(memory_format=torch.contiguous_format)
            for t in args
        ]
        with _current([s[:4] for s in segments], self.modules, self.base):
            hidden, *outputs = self.graph(args[0].shape[1])(*args)
        self.calls += 1
        n = b * q
        if rider is not None:
            shape = rider.ids.shape
            rider.hidden = hidden[:, n:].reshape(*shape, -1)
            rider.layers = [h[:, n:].reshape(*shape, -1) for h in outputs]
            rider.fed = True
        out = BaseModelOutputWithPast(last_hidden_state=hidden[:, :n].view(b, q, -1), past_key_values=cache)
        out.layer_outputs = [h[:, :n].view(b, q, -1) for h in outputs]
        return out

    def _segment(self, ids, attention_mask, position_ids, cache) -> tuple:
        """One batch's part of a forward: (cache, 4-D mask, (rows, tokens), its attention planned
        (attention.plan) or None, its flat graph inputs: ids [1, n], cos and sin [K, n, D])."""
        b, q = ids.shape
        shape = self.stack.norm.weight.new_empty(b, q, 1)  # what the mask is built for: rows, tokens, dtype
        mask = create_causal_mask(
            config=self.decoder.config,
            inputs_embeds=shape,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            allow_is_causal_skip=not self.windows,  # no mask: every key seen, and a window seen past
        )
        cos, sin = rotary(self.decoder, self.stack.kinds, shape, position_ids.expand(b, q))
        flat = [ids.reshape(1, b * q)] + [t.reshape(t.shape[0], b * q, t.shape[-1]) for t in (cos, sin)]
        return cache, mask, (b, q), attention.plan(cache, mask, self.decoder.config), flat


def _windowed_cache(cache, use_cache: bool | None) -> bool:
    """For a model with sliding layers: whether the forward's cache keeps only a window of some
    layer's entries (transformers' own sliding layers, whose masks transformers builds per layer
    kind): the graph's one mask serves caches that keep every entry (batchspec's), so such a
    forward runs eager."""
    if cache is None:
        return bool(use_cache)  # transformers' cache would be made, with sliding layers
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _frozen(lazy, tag: str):
    """The frozen graph under torch.compile (`lazy()`), called with inductor's freezing on: dynamo
    reads it as it traces (a parameter is then a constant of the graph, not an input), which a
    compile's `options` set only later, for inductor. inductor's cache keys a frozen graph by its
    weights' shapes alone: `tag`, the weights' digest, is added to the key (`cache_key_tag`), so
    another model of the same shapes never loads these kernels."""
    _plain_weight_packing()
    graph = lazy()

    def call(*args):
        with torch._inductor.config.patch(freezing=True), torch.compiler.config.patch(cache_key_tag=tag):
            return graph(*args)

    return call


def _numbered(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's linear layers a graph calls (`batchspec::product`), each numbered in its
    `batchspec_slot` (its place past the decoder's first: the same numbers on every call). A
    QuantLinear is traced into the graph (LeanStack.product): no slot."""
    linears_ = [x for layer in decoder.layers for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    linears_ = [x for x in linears_ if not isinstance(x, QuantLinear)]
    for slot, linear in enumerate(linears_):
        linear.batchspec_slot = slot
    return linears_


@torch.inference_mode()
def _packages_cached(decoder: torch.nn.Module, tag: str, options: dict) -> bool:
    """Whether both of `decoder`'s frozen graphs (one token, and more) under `options`, their
    weights digested as `tag`, are packages in the tuning cache (their keys hold the slots)."""
    _numbered(decoder)
    stack = LeanStack(decoder, "plain")
    return all(packaged.cached(stack, one, tag, options) for one in (True, False))


def _frozen_options(autotune: bool) -> dict:
    """inductor's options for a frozen graph (`autotune`: its products tuned C++ kernels)."""
    return {"freezing": True} | (AUTOTUNE if autotune else {})


def _weights_tag(weights: list[torch.Tensor]) -> str:
    """A frozen graph's cache key tag: the digest of the weights frozen into it."""
    return f"batchspec-frozen-{_digest(weights)}"


def _tuned_key(model: torch.nn.Module) -> dict:
    """The key of `model`'s TUNED record: its identity (a file's hash where it was loaded from one)
    and the tuned graphs' options."""
    return {"model": diskcache.model_identity(model), "options": _frozen_options(True)}


def mark_tuned(model: torch.nn.Module) -> None:
    """Record that `model`'s tuned packages (--max-autotune) are in the tuning cache."""
    diskcache.write(TUNED, _tuned_key(model), True)


def tuned_cached(model: torch.nn.Module) -> bool:
    """Whether `model`'s tuned packages (--max-autotune) are in the tuning cache, so a default
    start can load them in seconds. Only a model with a TUNED record has its weights digested
    (about 1.3 s a GB): a model never tuned costs a file read."""
    if diskcache.root() is None or not diskcache.read(TUNED, _tuned_key(model)):
        return False
    decoder = model.get_decoder()
    tag = _weights_tag(list(LeanStack(decoder).parameters()))  # the weights CompiledDecoder.frozen takes
    return _packages_cached(decoder, tag, _frozen_options(True))


def _unchanged(graph, weights: list[torch.Tensor], versions: list[int]):
    """`graph` (one with `weights` frozen into it at `versions`), refusing a call once a weight was
    changed in place since: its constants would be stale."""

    def call(*args):
        if any(v is not None and w._version != v for w, v in zip(weights, versions)):
            raise BatchspecError("the target's weights changed in place after --max-autotune froze them into its graph")
        return graph(*args)

    return call


def _plain_weight_packing() -> None:
    """Set inductor's freezing passes up without their oneDNN weight packing, once a process and
    before a frozen graph compiles. That pass packs each frozen weight as a oneDNN tensor (for
    ATen's linear among the autotune choices), which inductor's cache cannot save, so such a graph
    was compiled and tuned on every start; the C++ GEMM kernels pack their own copies as plain
    tensors. (After a frozen graph has compiled in the process it is too late: graphs then work
    as before but are not kept.)"""
    from torch._inductor.fx_passes import freezing_patterns

    with torch._inductor.config.patch({"cpp.weight_prepack": False}):
        freezing_patterns.lazy_init()


def _digest(weights: list[torch.Tensor]) -> str:
    """A digest of the weights' values (about 1.3 s a GB on 2 cores)."""
    h = hashlib.blake2b(digest_size=16)
    for w in weights:
        h.update(w.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@contextlib.contextmanager
def _current(segments, modules, base):
    _CURRENT.update(segments=segments, modules=modules, base=base)
    try:
        yield
    finally:
        _CURRENT.clear()


def cache_dir(folder: str | os.PathLike | None) -> None:
    """Keep inductor's compiled code in `folder` (the tuning cache's; unless the user chose a place),
    or nowhere (None: the cache is off)."""
    if folder is None:
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    elif "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")


def install(model: torch.nn.Module, backend: str = "inductor", freeze: bool = False, autotune: bool = False) -> None:
    """Serve `model`'s decoder by a compiled graph where it can (`why_not` is None; its layers
    lean.install'ed, before its linear layers are tuned)."""
    decoder = model.get_decoder()
    # Each compiled model is a recompile of the one LeanStack.forward (guards on the module): a
    # target and its self-draft take about six graphs, a process loading several pairs more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if getattr(decoder, "batchspec_compiled", None) is None:
        compiled = CompiledDecoder(decoder, decoder.forward, backend, freeze, autotune)
        decoder.forward = compiled
        decoder.batchspec_compiled = compiled


def compiled(model: torch.nn.Module) -> CompiledDecoder | None:
    """`model`'s compiled decoder, or None (eager)."""
    get = getattr(model, "get_decoder", None)
    return None if get is None else getattr(get(), "batchspec_compiled", None)


def form(model: torch.nn.Module) -> str:
    """How `model`'s forward runs, where its timings depend on it: eager, the default graph, frozen
    graphs, or frozen graphs with tuned kernels (--max-autotune)."""
    found = compiled(model)
    return "eager" if found is None else "tuned" if found.autotune else "frozen" if found.freeze else "graph"


@torch.inference_mode()
def warm(model: torch.nn.Module) -> float:
    """Compile (or load from the tuning cache) both graphs now, not in the first step; seconds taken."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    cache = kv.reference_cache(model.config, full=True)
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)  # two tokens: the graph for N > 1
    model(input_ids=ids[:, :1], cache=cache, use_cache=True, logits_to_keep=1)  # one token
    return time.perf_counter() - started
