"""Turning logits into the distributions that are sampled and matched, and sampling from them.

Pure tensor functions. The same `probabilities` is applied to draft and target logits, so the
processed (temperature, top-k, top-p) distributions are the ones rejection sampling matches.
Sampling is by inverse CDF from uniforms drawn per row from the row's own generator, in float64,
so a row's tokens depend only on its seed and its logits, never on the batch around it.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] (float32) after temperature, top-k, then top-p.

    Invariant: every row sums to 1 and the argmax token always keeps non-zero probability.
    """
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (rows need not be normalised), uniforms [B] in [0, 1).

    Returns token ids [B]. A zero-probability token is never returned for a row with mass > 0.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.double().to(cdf.device) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; `None` draws a fresh random seed."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def draw_uniforms(generators: list[torch.Generator], n: int) -> torch.Tensor:
    """[B, n] float64 uniforms, row b from generators[b] (a fixed order of use per row)."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])
