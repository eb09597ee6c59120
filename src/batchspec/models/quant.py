"""Weight-only quantized copies of a model's linear layers, and the target's own quantized copy
as a draft model (`--draft self`).

A draft's numerics never change the output, only how many drafts are accepted; what a draft must
be is cheap per step. On a CPU a small-batch forward streams every weight from memory once, so a
weight's bytes set its cost. PyTorch ships CPU kernels for weight-only products, which this module
uses as they are:
- int8: `torch.ops.aten._weight_int8pack_mm` (one scale per output channel, symmetric);
- int4: `torch.ops.aten._weight_int4pack_mm_for_cpu` (asymmetric, one scale and offset per group
  of GROUP inputs); a model's LM head stays int8 (`quantize`, `self_draft`).
Both are fast with bfloat16 activations only (int8 with float32 rows is 5-40x slower here), so a
quantized layer computes in bfloat16 and returns its caller's dtype. Measured on 2 cores of an AMD
EPYC with AVX512-BF16, one sweep over SmolLM2-135M's 210 decoder weights (`python
experiments/quant_forms.py`): docs/benchmarks.md, "A draft from the target itself".
"""

from __future__ import annotations

import copy

import torch

from ..core.errors import BatchspecError
from . import lean
from .linears import TunedLinear

QUANTS = ("none", "int8", "int4")
#: Above this many rows a product dequantizes the weight to bfloat16 and multiplies that: the int8
#: kernel's time grows with each row (prefill), a dense product's far less (experiments/quant_forms.py).
DENSE_ROWS = 32
#: Inputs per int4 group (one scale and offset each); a layer whose input width it does not divide
#: (or whose outputs are not a multiple of the kernel's 16) stays int8. Measured on the built-in
#: pair's target (teacher-forced along its own greedy continuations, 16 prompts, 738 positions; LM
#: head int8): groups of 64 agree with the target at 79% of positions, groups of 32 at 98% (int8
#: everywhere: 96%), for ~5% more time per product.
GROUP = 32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] -> (int8 [O, I], scales [O] bf16): weight ~ int8 * scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    return (w / scales[:, None].float()).round().clamp(-127, 127).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, I] -> (packed int4 for the CPU kernel, scales and offsets [I / group, O, 2] bf16):
    within each group of `group` inputs, weight ~ (q - 8) * scale + offset with q in 0..15."""
    w = weight.detach().float()
    out, width = w.shape
    grouped = w.reshape(out, width // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out, width)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    offset = low + 8 * scale  # the kernel computes (q - 8) * scale + offset
    pairs = torch.stack([scale.reshape(out, -1), offset.reshape(out, -1)], dim=-1)
    return packed, pairs.transpose(0, 1).contiguous().to(torch.bfloat16)


def unpack_int4(packed: torch.Tensor, out: int, width: int) -> torch.Tensor | None:
    """The kernel's packed int4 weight -> q [O, I] int32 in 0..15, by bit shifts (O x I work, not
    the O x I x I of a product with the identity); None where the packing is not the one read here
    (blocks of 64 outputs, each byte holding outputs n and n + 32 of one input: the AVX-512 form,
    checked once by a round trip), or O is not a whole number of blocks."""
    if out % 64 or not _known_int4_layout():
        return None
    return _unpack_blocks(packed, out, width)


_LAYOUT: list[bool] = []


def _known_int4_layout() -> bool:
    if not _LAYOUT:
        q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        _LAYOUT.append(packed.shape == (128, 32) and bool((_unpack_blocks(packed, 128, 64) == q).all()))
    return _LAYOUT[0]


def _unpack_blocks(packed: torch.Tensor, out: int, width: int) -> torch.Tensor:
    blocks = packed.view(out // 64, width, 32)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [O/64, I, 64]: outputs n, then n + 32
    return q.transpose(1, 2).reshape(out, width).to(torch.int32)


def int8_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows [M, I] bf16 (contiguous) x int8 weight packed [O, I] with scales [O] -> [M, O] bf16: the
    kernel for up to DENSE_ROWS rows, the dequantized weight's product above."""
    if rows.shape[0] > DENSE_ROWS:
        return torch.nn.functional.linear(rows, packed.to(torch.bfloat16) * scales[:, None])
    return torch.ops.aten._weight_int8pack_mm(rows, packed, scales)


class QuantLinear(torch.nn.Module):
    """A linear layer [.., I] -> [.., O] over a weight-only quantized copy of `weight` [O, I]; it
    computes in bfloat16 and returns its input's dtype. The quantized weight and its scales are
    buffers: the layer has no Parameters of its own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.group = GROUP  # int4's inputs per group, as quantized
        whole = self.in_features % self.group == 0 and self.out_features % 16 == 0  # the kernel's blocks
        _known_int4_layout()  # checked here, never inside a compiled graph
        self.kind = "int4" if kind == "int4" and whole else "int8"
        packed, scales = quantize_int4(weight, self.group) if self.kind == "int4" else quantize_int8(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())
        self.keep_dense = False  # keep the dequantized weight once made (`dense`)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # the kernels need it
        # In a compiled graph (at most compiled.MAX_ROWS tokens) always the kernel: a branch on the
        # row count would compile a graph more, mid-run.
        if not torch.compiler.is_compiling() and rows.shape[0] > DENSE_ROWS:
            out = torch.nn.functional.linear(rows, self.dense())
        elif self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dense(self) -> torch.Tensor:
        """The weight [O, I] dequantized to bfloat16: made for each call, or once and kept where
        `keep_dense` (a prompt's products then cost a dense bfloat16 product, no more)."""
        if self.kept is not None:
            return self.kept
        weight = self._dequantized()
        if self.keep_dense:
            self.kept = weight
        return weight

    def _dequantized(self) -> torch.Tensor:
        if self.kind == "int8":
            return self.packed.to(torch.bfloat16) * self.scales[:, None]
        q = unpack_int4(self.packed, self.out_features, self.in_features)
        if q is None:  # another packing: the kernel's own product with the identity
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales).T
        scale, offset = self.scales.float().permute(2, 1, 0)[..., None]  # [O, I / group, 1] each
        grouped = (q.view(self.out_features, -1, self.group) - 8) * scale + offset
        return grouped.reshape(self.out_features, self.in_features).to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def _replace_linears(model: torch.nn.Module, make) -> None:
    """Swap every linear layer of `model` (nn.Linear or TunedLinear) for `make(layer)`, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (torch.nn.Linear, TunedLinear):
                setattr(parent, name, make(child))


def _quantizer(model: torch.nn.Module, kind: str):
    """layer -> its QuantLinear of `kind`, but int8 for `model`'s LM head under int4: the head picks
    the token: an int4 head (groups of 32) cut the built-in pair's self-draft's agreement with the
    target from 98% to 91% and saved no time measurably."""
    head = model.get_output_embeddings()

    def make(layer: torch.nn.Module) -> QuantLinear:
        return QuantLinear(layer.weight, layer.bias, "int8" if layer is head else kind)

    return make


def check(kind: str, device: torch.device | str) -> None:
    """Refuse a quantization this module does not know, or one whose kernels `device` lacks."""
    if kind not in QUANTS:
        raise BatchspecError(f"unknown draft quantization {kind!r}; choose one of {', '.join(QUANTS)}")
    if kind != "none" and torch.device(device).type != "cpu":
        raise BatchspecError(
            f"--draft-quant {kind} runs on CPUs only (PyTorch's weight-only kernels); the draft is on "
            f"{device}: use --draft-quant none there"
        )


def quantize(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Swap every linear layer of `model` (nn.Linear or TunedLinear) for a QuantLinear of `kind`
    ("none": nothing changes), in place, each keeping its dequantized bfloat16 weight once a
    product of more than DENSE_ROWS rows made it (a draft model's prompt; a self-draft, which
    takes the target's entries for its prompts, keeps none). Needs a CPU model: the kernels are
    PyTorch's CPU ones."""
    check(kind, next(model.parameters()).device)
    if kind != "none":
        _replace_linears(model, _quantizer(model, kind))
        for layer in model.modules():
            if isinstance(layer, QuantLinear):  # a prompt's products: a dense bfloat16 product (a
                layer.keep_dense = True  # 2-byte copy, made at the first): no dearer than float32's
    return model


class _Compute(torch.nn.Module):
    """Wraps a model's input embedding so that what it returns is cast to `dtype` (the rest of the
    model then computes in that dtype while the embedding's weight stays shared)."""

    def __init__(self, embedding: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner, self.dtype = embedding, dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids).to(self.dtype)


def self_draft(target: torch.nn.Module, kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """The target's own copy as a draft model: every linear layer (the LM head too) quantized to
    `kind`, the rest (norms, rotary tables) cast to `dtype`, which it computes in; the input
    embedding is the target's own Parameter (shared, not copied). The target is not changed."""
    shared = {id(p): p for p in target.parameters()}
    shared |= {id(m.table): m.table for m in target.modules() if isinstance(m, TunedLinear)}
    draft = copy.deepcopy(target, memo=shared)  # new modules; the target's Parameters in them
    lean.install(draft)  # Llama-form layers in fewer operations (its products fused)
    if kind == "none":  # its own copy in dtype
        _replace_linears(draft, lambda layer: _cast_copy(layer, dtype))
    else:
        _replace_linears(draft, _quantizer(draft, kind))
    embedding = draft.get_input_embeddings()
    for module in draft.modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            if id(param) in shared and module is not embedding:
                setattr(module, pname, torch.nn.Parameter(param.detach().to(dtype).clone(), requires_grad=False))
        for bname, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and not isinstance(module, QuantLinear):
                setattr(module, bname, buf.to(dtype) if not bname.endswith("inv_freq") else buf)
    draft.set_input_embeddings(_Compute(embedding, dtype))
    draft.compute_dtype = dtype  # what kv.entry_dtype reads: its KV entries are in dtype
    return draft.eval()


def _cast_copy(layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Linear:
    """An nn.Linear holding its own copy of `layer`'s weight (and bias) in `dtype`."""
    copy_ = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    copy_.weight = torch.nn.Parameter(layer.weight.detach().to(dtype).clone(), requires_grad=False)
    if layer.bias is not None:
        copy_.bias = torch.nn.Parameter(layer.bias.detach().to(dtype).clone(), requires_grad=False)
    return copy_


def own_bytes(model: torch.nn.Module, other: torch.nn.Module | None = None) -> int:
    """Bytes of `model`'s parameters and buffers that `other` does not share."""
    shared = set() if other is None else {p.data_ptr() for p in other.parameters()}
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers()) if t.data_ptr() not in shared}
    return sum(t.numel() * t.element_size() for t in tensors.values())
