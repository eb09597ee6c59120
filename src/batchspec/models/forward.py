"""The models' forward passes: `forward` is the single place a model is called by the batched
methods (a layout supplies the mask, positions and cache); `decoder_features` is the target's
forward that also returns the features a draft head reads (proposers/eagle.py).

A forward may carry a `Rider`: another batch's tokens (a prompt's next chunk, with its own mask,
positions and cache) computed in the same pass, so they cost their tokens' share of it and not a
forward of their own. Only a compiled decoder (compiled.py) carries one; elsewhere, or where the
compiled graph does not serve that forward, the rider is left unfed (`fed` False) and its owner
feeds it alone, as before."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import compiled


@dataclass
class Rider:
    """ids [b, n] to feed with their own inputs (attention mask, position ids, cache), carried in
    another forward of the same model. After it: `fed`, and their final hidden states [b, n, W]
    and every layer's output (`layers`), from which `features` [b, n, F] are made where asked."""

    ids: torch.Tensor
    inputs: dict
    completes: bool = False  # the chunk ends its prompt: the owner picks the first token from `hidden`
    cost_s: float | None = None  # the owner's estimate of its share of a forward (None: none yet)
    fed: bool = False
    hidden: torch.Tensor | None = None
    layers: list | None = None
    features: torch.Tensor | None = None


def carried(rider: Rider | None) -> bool:
    """Whether a forward carried `rider` (None: there was none)."""
    return rider is not None and rider.fed


def carries(model) -> bool:
    """Whether `model`'s forwards can carry a rider at all (its decoder is compiled)."""
    return compiled.compiled(model) is not None


@contextlib.contextmanager
def carrying(model, rider: Rider | None):
    """Offer `rider` to `model`'s next forward (the compiled decoder takes it if that forward is one
    its graph serves)."""
    decoder = compiled.compiled(model) if rider is not None else None
    if decoder is None:
        yield
        return
    decoder.rider = rider
    try:
        yield
    finally:
        decoder.rider = None


def forward(
    model, ids: torch.Tensor, inputs: dict, last_only: bool = False, rider: Rider | None = None
) -> torch.Tensor:
    """ids [B, q] -> logits [B, q, V] (or [B, 1, V] with last_only); the cache in `inputs` grows
    (and the rider's, if it was carried)."""
    with carrying(model, rider):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **inputs)
    return out.logits


def shifted(features: torch.Tensor) -> torch.Tensor:
    """Target features [B, n, H] at positions 0..n-1 -> the head's feature inputs [B, n, H] for
    tokens 0..n-1: f(t - 1), zeros for t = 0."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def decoder_features(
    target, aux_layers: tuple[int, ...] = (), rider: Rider | None = None, **inputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's decoder over `inputs` (input_ids [B, q], cache, ...) -> (final hidden states
    [B, q, H], what its LM head reads; features [B, q, H (1 + A)]: those, then the output of each
    layer in `aux_layers` RMS-normalised without weight). One forward; the aux outputs are caught
    by hooks, not by keeping every layer's (a compiled decoder, compiled.py, returns them all).
    A carried rider gets its own features."""
    decoder = target.get_decoder()
    caught: list[torch.Tensor] = []
    catch = lambda _module, _args, out: caught.append(out)  # noqa: E731
    hooks = [decoder.layers[i].register_forward_hook(catch) for i in sorted(aux_layers)]
    try:
        with carrying(target, rider):
            out = decoder(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = out.last_hidden_state
    if getattr(out, "layer_outputs", None) is not None:  # a compiled decoder's forward: no hooks ran
        caught = [out.layer_outputs[i] for i in sorted(aux_layers)]
    if rider is not None and rider.fed:
        rider.features = _features(rider.hidden, [rider.layers[i] for i in sorted(aux_layers)])
    return hidden, _features(hidden, caught)


def _features(hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    """Final hidden states [B, q, H] and aux layers' outputs -> features [B, q, H (1 + A)]."""
    if not aux:
        return hidden
    aux = [(h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype) for h in aux]
    return torch.cat([hidden, *aux], dim=-1)


@torch.inference_mode()
def reference_features(target, ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's features [1, n, F] over ids [1, n], unbatched (for checks)."""
    return decoder_features(target, aux_layers, input_ids=ids)[1]
