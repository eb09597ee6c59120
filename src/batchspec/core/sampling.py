"""Turning logits into distributions, and picking tokens from them.

Pure tensor functions. The same `probabilities` is applied to draft and target logits.
Parameters are per row (`RowParams`, tensors [B]): one batch may mix greedy and sampled rows with
different temperatures, top-p and top-k. A greedy row (temperature 0) gets the one-hot
distribution of its argmax.

Sampling is coupled to token positions (Gumbel-max): the token at position t of a request is
argmax(log p_t + g_t), with Gumbel noise g_t from a generator keyed by (the request's seed, t).
Speculative verification is then the greedy rule against the target's own pick at each position
(a draft is kept iff it equals it), so a row's tokens are a function of its seed and the target
alone: the same whatever the batch around it, the method, or how many drafts each step verified,
and equal, token for token, to `reference` under the same seed. The output follows the target's
distribution exactly (each g_t is independent of everything before t). A draft model samples its
proposals with the same g_t (Gumbel coupling), so it agrees with the target often when its
distribution is close."""

from __future__ import annotations

import secrets
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


def greedy(logits: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """logits [..., V] -> the argmax over V, found in float32: the same index (the conversion is
    exact and keeps order), and CPU kernels take 3x as long over bfloat16 as convert-then-argmax."""
    return logits.float().argmax(dim=-1, keepdim=keepdim)


def probabilities(logits: torch.Tensor, params: SamplingParams | RowParams) -> torch.Tensor:
    """logits [B, ..., V] -> probs [B, ..., V] (float32) after temperature, top-k, then top-p, with
    row b's parameters; a shared SamplingParams applies to every row (then logits may be [..., V]).

    Invariant: every row sums to 1 and the argmax token always keeps non-zero probability; a
    greedy row is one-hot at its argmax. A row's result does not depend on the other rows.
    """
    shared = isinstance(params, SamplingParams)
    rows = RowParams.of([params], logits.device) if shared else params
    shape = (1,) * logits.dim() if shared else (-1,) + (1,) * (logits.dim() - 1)  # [B] over [B, ..., V]
    argmax_rows = (rows.temperature == 0).view(shape)
    temperature = torch.where(rows.temperature == 0, 1.0, rows.temperature).view(shape)
    full = logits.float()  # converted once, for the distribution and the greedy rows' argmax
    scaled = _top_k(full / temperature, rows.top_k.view(shape))
    probs = _top_p(torch.softmax(scaled, dim=-1), rows.top_p.view(shape))
    if bool(argmax_rows.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy(full, keepdim=True), 1.0)
        probs = torch.where(argmax_rows, one_hot, probs)
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


def request_seed(seed: int | None) -> int:
    """The seed of a sampled request: its own, or a fresh random one when it gave none."""
    return seed if seed is not None else secrets.randbits(63)


def _key(seed: int, position: int) -> int:
    """A 64-bit generator seed for (request seed, token position): splitmix64 of the pair."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


_MASK = (1 << 64) - 1


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[V] Gumbel(0, 1) noise of token position `position` of a request: a function of
    (seed, position) alone, so it is the same whichever step, batch or method picks that token."""
    u = torch.rand(vocab, generator=torch.Generator().manual_seed(_key(seed, position)), dtype=torch.float64)
    return -torch.log(-torch.log(u)).float()  # u == 0 gives -inf: that token is never picked


def row_noise(seqs: list, width: int, vocab: int, device=None) -> torch.Tensor:
    """[B, width, V] noise for the next `width` token positions of each row (positions
    len(seq) .. len(seq) + width - 1); zeros for greedy rows (seed None). Each row keeps the noise of
    positions it has not committed yet (`seq.noise`), so a rejected position is not drawn twice."""
    out = torch.zeros(len(seqs), width, vocab)
    for b, seq in enumerate(seqs):
        if seq.seed is None:
            continue
        start = len(seq)
        seq.noise = {t: g for t, g in seq.noise.items() if t >= start}
        for i in range(width):
            if start + i not in seq.noise:
                seq.noise[start + i] = gumbel(seq.seed, start + i, vocab)
            out[b, i] = seq.noise[start + i]
    return out.to(device)


def choose(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [..., V], noise [..., V] -> token ids [...]: argmax(log probs + noise), the Gumbel-max
    trick. With Gumbel noise the token follows `probs` exactly; with zero noise (a greedy row, whose
    probs are one-hot) it is the argmax. A zero-probability token is never chosen."""
    return (probs.float().log() + noise.to(probs.device)).argmax(dim=-1)
