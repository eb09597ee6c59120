"""A lean decoder layer for Llama-family and Gemma 3 models: the same function in fewer operations.

At one or a few rows a small model's forward on a CPU is mostly the fixed cost of each operation
(dispatch, allocation, Python), not its arithmetic: transformers' Llama layer runs about 80 of
them, three products for q, k, v and two for the gate and up projections. `LeanLayer` computes the
layer in about 20: one product for q, k and v together and one for gate and up (their weights
concatenated by output rows, so a weight-only quantization per output row is the same as the
three or two apart), RoPE on q and k at once, fused RMS norms (the per-head q and k norms of Qwen3
and Gemma 3 too; Gemma's four norms a layer, in its own form). Attention and the cache are the
engine's own (attention.py, the layout's cache), called as transformers calls them; a sliding
layer's window is cut from the mask there.

A self-draft always gets it (`quant.self_draft`); the target gets it when its decoder is compiled
(compiled.py, which runs `LeanLayer.step` in one graph): the reference runs the same target, so the
oracle shares its numerics. Layers of other architectures (Llama-form layers with windows, other
norms or activations) are left as they are (`supported`).
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

#: transformers' decoder layers of this form: RMSNorm, q/k/v/o, SiLU-gated MLP, RoPE; Qwen3's with
#: an RMS norm over each head's dimensions of q and of k before RoPE (q_norm, k_norm).
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
QK_NORMED = ("Qwen3DecoderLayer",)
#: Gemma 3's layers: norms that scale by 1 + weight in float32, around the attention and the MLP
#: (four a layer), q and k normed per head, a GELU-gated MLP, and sliding-window layers (their own
#: RoPE table) among the full ones; the window is cut from the mask (attention.windowed).
GEMMA = ("Gemma3DecoderLayer",)


def supported(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a layer `LeanLayer` computes: a full-attention Llama-form one, or Gemma 3's."""
    name = type(layer).__name__
    if name in GEMMA:
        return getattr(layer.self_attn, "attn_logit_softcapping", None) is None
    if name not in LAYERS:
        return False
    config, attn = layer.self_attn.config, layer.self_attn
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if types is not None:
        sliding = types[attn.layer_idx] == "sliding_attention"
    qk_norm = hasattr(attn, "q_norm") or hasattr(attn, "k_norm")
    return config.hidden_act == "silu" and not sliding and (not qk_norm or name in QK_NORMED)


def _fused(*layers: torch.nn.Module) -> torch.nn.Linear:
    """One linear layer whose output is the outputs of `layers` side by side (weights and biases
    concatenated by output rows; a new tensor in their dtype)."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=layers[0].bias is not None, device="meta")
    out.weight = torch.nn.Parameter(weight, requires_grad=False)
    if layers[0].bias is not None:
        out.bias = torch.nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
    return out


class LeanLayer(torch.nn.Module):
    """A decoder layer `supported` computes, in fewer operations; transformers' decoder layer's call
    signature and result. Gemma 3's (`gemma`) differs in its norms, their number and the activation."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        config = attn.config
        self.gemma = type(layer).__name__ in GEMMA
        self.qkv = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        self.gate_up = _fused(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.act = ACT2FN[config.hidden_activation if self.gemma else config.hidden_act]
        # the norms: before attention and before the MLP; Gemma's also after each (else None)
        norms = ("input_layernorm", "post_attention_layernorm", None, None)
        if self.gemma:
            norms = (
                "input_layernorm",
                "pre_feedforward_layernorm",
                "post_attention_layernorm",
                "post_feedforward_layernorm",
            )
        self.names = dict(_NAMES)  # this layer's own names -> transformers' layer's (_original_names)
        for own, name in zip(("norm_attn", "norm_mlp", "norm_attn_out", "norm_mlp_out"), norms):
            setattr(self, own, getattr(layer, name).weight if name else None)
            if name:
                self.names[own] = f"{name}.weight"
        first = layer.input_layernorm
        self.eps = first.eps if self.gemma else first.variance_epsilon
        self.norm_q = self.norm_k = None  # per-head norms of q and k (Qwen3, Gemma 3; weights [D])
        if hasattr(attn, "q_norm"):
            self.norm_q, self.norm_k = attn.q_norm.weight, attn.k_norm.weight
            self.eps_qk = attn.q_norm.eps if self.gemma else attn.q_norm.variance_epsilon
            del attn.q_norm, attn.k_norm
        self.dim, self.heads, self.kv_heads = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.scaling, self.layer_idx = attn.scaling, attn.layer_idx
        types = getattr(config, "layer_types", None) if self.gemma else None
        self.rope_kind = types[attn.layer_idx] if types else None  # which RoPE table (Gemma: one per layer kind)
        self.window = getattr(attn, "sliding_window", None) if self.gemma else None
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # held above, fused or as they are
            delattr(attn, name)
        self.attn = (attn,)  # what the attention function reads (config, layer_idx); not a submodule
        self._register_state_dict_hook(_original_names)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, q, H]
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [B, q, D]
        **kwargs,
    ) -> torch.Tensor:
        if self.window is not None:
            kwargs["sliding_window"] = self.window  # as transformers' attention passes it

        def attend(query, key, value, layer_idx):
            return cached_attention(self.attn[0], cache, attention_mask, query, key, value, layer_idx, **kwargs)

        return self.step(hidden_states, *position_embeddings, attend, _call)

    def step(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, product=None):
        """hidden [B, q, W], cos/sin [B, q, D] -> the layer's output [B, q, W]; `attend(query [B, H, q, D],
        key, value [B, H_kv, q, D], layer index) -> [B, q, H * D]` writes the cache and attends.
        `product(x, layer)`: how each of the four products is computed (default: a plain product of
        the layer's weight, which a compiler traces; the eager forward calls the layer itself, which
        may be tuned or quantized)."""
        product = product or _linear
        b, q, width = hidden.shape
        h = self._norm(hidden, self.norm_attn)
        qkv = product(h, self.qkv)
        n_qk = (self.heads + self.kv_heads) * self.dim
        qk = qkv[..., :n_qk].view(b, q, self.heads + self.kv_heads, self.dim)
        if self.norm_q is not None:
            queries, keys = qk[:, :, : self.heads], qk[:, :, self.heads :]
            qk = torch.cat([self._head_norm(queries, self.norm_q), self._head_norm(keys, self.norm_k)], dim=2)
        qk = _rope(qk, cos, sin)
        query, key = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
        value = qkv[..., n_qk:].view(b, q, self.kv_heads, self.dim).transpose(1, 2)
        out = product(attend(query, key, value, self.layer_idx), self.o_proj)
        hidden = hidden + (out if self.norm_attn_out is None else self._norm(out, self.norm_attn_out))
        h = self._norm(hidden, self.norm_mlp)
        gate, up = product(h, self.gate_up).chunk(2, dim=-1)
        out = product(self.act(gate) * up, self.down)
        return hidden + (out if self.norm_mlp_out is None else self._norm(out, self.norm_mlp_out))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [.., W] RMS-normed over W: transformers' Llama norm (in x's dtype, times the weight) or
        Gemma's (in float32, times 1 + the weight)."""
        if self.gemma:
            return _gemma_norm(x, weight, self.eps)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [B, q, heads, D] RMS-normed over D, as transformers' Qwen3RMSNorm (in float32, the weight
        applied in x's dtype) or Gemma3RMSNorm computes it."""
        if self.gemma:
            return _gemma_norm(x, weight, self.eps_qk)
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps_qk)
        return weight * normed.to(x.dtype)


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm: x RMS-normed over its last dimension in float32, times 1 + weight, in x's dtype."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1.0 + weight.float())).type_as(x)


def cached_attention(module, cache, mask, query, key, value, layer: int, **kwargs) -> torch.Tensor:
    """query [B, H, q, D], key/value [B, H_kv, q, D] of layer `layer` -> [B, q, H * D]: the new entries
    written to `cache` (if any), then the model's attention function (`module`'s config names it)
    over the cache with `mask`, as transformers' layers call it."""
    if cache is not None:
        key, value = cache.update(key, value, layer, kwargs=kwargs)
    function = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    out, _ = function(module, query, key, value, mask, dropout=0.0, scaling=module.scaling, **kwargs)
    return out.reshape(query.shape[0], query.shape[2], -1)


#: A LeanLayer's own names -> transformers' layer's, but for its norms (LeanLayer.names) and its
#: products split back (q, k, v; gate, up).
_NAMES = {
    "norm_q": "self_attn.q_norm.weight",
    "norm_k": "self_attn.k_norm.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "o_proj.bias": "self_attn.o_proj.bias",
    "down.weight": "mlp.down_proj.weight",
}


def _original_names(layer: LeanLayer, state: dict, prefix: str, _metadata) -> dict:
    """A LeanLayer's state dict under transformers' layer's names, its fused products split back,
    so a model holding lean layers saves (`save_pretrained`) as the model it was made from."""
    for name, original in layer.names.items():
        if prefix + name in state:
            state[prefix + original] = state.pop(prefix + name)
    sizes = (layer.heads * layer.dim, layer.kv_heads * layer.dim, layer.kv_heads * layer.dim)
    for fused, parts, split in (("qkv", ("q", "k", "v"), sizes), ("gate_up", ("gate", "up"), None)):
        owner = "self_attn" if fused == "qkv" else "mlp"
        for kind in ("weight", "bias"):
            value = state.pop(f"{prefix}{fused}.{kind}", None)
            if value is None:
                continue
            pieces = value.split(split) if split else value.chunk(2)
            for part, piece in zip(parts, pieces):
                state[f"{prefix}{owner}.{part}_proj.{kind}"] = piece
    return state


def _call(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    return layer(x)


def _linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """x @ layer.weight^T (+ bias) as one plain product."""
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, q, heads, D] rotated by cos, sin [B, q, D] (transformers' rotate-half convention)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def install(model: torch.nn.Module) -> int:
    """Replace every `supported` decoder layer of `model` (a transformers causal LM) with a
    LeanLayer, in place; the number replaced."""
    layers = model.get_decoder().layers
    count = 0
    for i, layer in enumerate(layers):
        if supported(layer):
            layers[i] = LeanLayer(layer)
            count += 1
    return count
