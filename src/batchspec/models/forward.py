"""The models' forward passes: `forward` is the single place a model is called by the batched
methods (a layout supplies the mask, positions and cache); `decoder_features` is the target's
forward that also returns the features a draft head reads (proposers/eagle.py)."""

from __future__ import annotations

import torch


def forward(model, ids: torch.Tensor, inputs: dict, last_only: bool = False) -> torch.Tensor:
    """ids [B, q] -> logits [B, q, V] (or [B, 1, V] with last_only); the cache in `inputs` grows."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **inputs)
    return out.logits


def shifted(features: torch.Tensor) -> torch.Tensor:
    """Target features [B, n, H] at positions 0..n-1 -> the head's feature inputs [B, n, H] for
    tokens 0..n-1: f(t - 1), zeros for t = 0."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def decoder_features(target, aux_layers: tuple[int, ...] = (), **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's decoder over `inputs` (input_ids [B, q], cache, ...) -> (final hidden states
    [B, q, H], what its LM head reads; features [B, q, H (1 + A)]: those, then the output of each
    layer in `aux_layers` RMS-normalised without weight). One forward; the aux outputs are caught
    by hooks, not by keeping every layer's (a compiled decoder, compiled.py, returns them all)."""
    decoder = target.get_decoder()
    caught: list[torch.Tensor] = []
    catch = lambda _module, _args, out: caught.append(out)  # noqa: E731
    hooks = [decoder.layers[i].register_forward_hook(catch) for i in sorted(aux_layers)]
    try:
        out = decoder(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = out.last_hidden_state
    if getattr(out, "layer_outputs", None) is not None:  # a compiled decoder's forward: no hooks ran
        caught = [out.layer_outputs[i] for i in sorted(aux_layers)]
    if not aux_layers:
        return hidden, hidden
    aux = [(h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype) for h in caught]
    return hidden, torch.cat([hidden, *aux], dim=-1)


@torch.inference_mode()
def reference_features(target, ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's features [1, n, F] over ids [1, n], unbatched (for checks)."""
    return decoder_features(target, aux_layers, input_ids=ids)[1]
