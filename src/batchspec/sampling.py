"""Turning logits into the distributions that are sampled and matched, and sampling from them.

Pure tensor functions. The same `probabilities` is applied to draft and target logits, so the
processed (temperature, top-k, top-p) distributions are the ones rejection sampling matches.
Parameters are per row (`RowParams`, tensors [B]): one batch may mix greedy and sampled rows with
different temperatures, top-p and top-k. A greedy row (temperature 0) gets the one-hot
distribution of its argmax, so rejection sampling over it is greedy acceptance, whatever its
uniforms. Sampling is by inverse CDF from uniforms drawn per row from the row's own generator, in
float64, so a row's tokens depend only on its seed and its logits, never on the batch around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters: temperature [B] (0 = greedy), top_p [B], top_k [B] (0 = off)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], device=None) -> RowParams:
        """Stack each row's SamplingParams into tensors."""
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        )

    @property
    def greedy(self) -> bool:
        """True when every row is greedy (the argmax fast path applies)."""
        return bool((self.temperature == 0).all())


def probabilities(logits: torch.Tensor, params: SamplingParams | RowParams) -> torch.Tensor:
    """logits [B, ..., V] -> probs [B, ..., V] (float32) after temperature, top-k, then top-p, with
    row b's parameters; a shared SamplingParams applies to every row (then logits may be [..., V]).

    Invariant: every row sums to 1 and the argmax token always keeps non-zero probability; a
    greedy row is one-hot at its argmax. A row's result does not depend on the other rows.
    """
    shared = isinstance(params, SamplingParams)
    rows = RowParams.of([params], logits.device) if shared else params
    shape = (1,) * logits.dim() if shared else (-1,) + (1,) * (logits.dim() - 1)  # [B] over [B, ..., V]
    greedy = (rows.temperature == 0).view(shape)
    temperature = torch.where(rows.temperature == 0, 1.0, rows.temperature).view(shape)
    scaled = _top_k(logits.float() / temperature, rows.top_k.view(shape))
    probs = _top_p(torch.softmax(scaled, dim=-1), rows.top_p.view(shape))
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def _top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """scaled [B, ..., V], top_k [B, 1.., 1] -> -inf below each row's k-th largest (0 or >= V: off)."""
    vocab = scaled.shape[-1]
    active = (top_k > 0) & (top_k < vocab)
    if not bool(active.any()):
        return scaled
    k = torch.where(active, top_k, 1)
    values = scaled.topk(int(k.max()), dim=-1).values  # [B, ..., k_max], descending
    kth = values.gather(-1, (k - 1).expand(*values.shape[:-1], 1))
    return scaled.masked_fill(active & (scaled < kth), float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest prefix (by probability) reaching top_p, renormalised; rows with
    top_p == 1 are returned untouched."""
    active = top_p < 1.0
    if not bool(active.any()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    drop_sorted = before >= top_p.to(probs.dtype)  # keeps the smallest prefix reaching top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    cut = probs.masked_fill(drop, 0.0)
    return torch.where(active, cut / cut.sum(dim=-1, keepdim=True), probs)


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


def draw_uniforms(generators: list[torch.Generator | None], n: int) -> torch.Tensor:
    """[B, n] float64 uniforms, row b from generators[b] (a fixed order of use per row); a greedy
    row (generator None) draws nothing and gets zeros, which its one-hot distributions ignore."""
    zeros = torch.zeros(n, dtype=torch.float64)
    return torch.stack([zeros if g is None else torch.rand(n, generator=g, dtype=torch.float64) for g in generators])
