"""Log-probabilities of emitted tokens, from the target's own logits at each emitted position.

A row that asks (`SamplingParams.logprobs = n`, 0 <= n <= MAX_LOGPROBS) gets, for every token it
emits, that token's log-probability and the n most likely tokens with theirs, under the target's
distribution at that position after the row's temperature (a greedy row: temperature 1, the
model's own distribution), before top-k/top-p truncation: what the token was picked from.

The logits are the ones the step picked the token from: the prefill's last column, a chain's
column j for its j-th emitted token, a tree's root then the accepted path's nodes. Never a draft's
and never a position past the first rejected draft. Rows that did not ask cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The most alternatives a row may ask for per position (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id and log-probability, and the `top` (id, log-probability) pairs,
    most likely first (ties: lower id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


def log_distribution(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, V], temperature [R] (0: greedy, read as 1) -> log-probabilities [R, V] (float32)."""
    t = torch.where(temperature > 0, temperature, 1.0).to(torch.float32)[:, None]
    return torch.log_softmax(logits.float() / t, dim=-1)


def entries(logits: torch.Tensor, tokens: list[int], temperatures: list[float], tops: list[int]) -> list[TokenLogprob]:
    """logits [R, V] at R emitted positions, the token emitted at each, its row's temperature and
    number of alternatives -> one TokenLogprob per position."""
    if not tokens:
        return []
    logp = log_distribution(logits, torch.tensor(temperatures))
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    most = max(tops)
    values, ids = logp.topk(min(most, logp.shape[-1]), dim=-1) if most else (None, None)
    out = []
    for r, (token, n) in enumerate(zip(tokens, tops)):
        pairs = sorted(zip(ids[r].tolist(), values[r].tolist()), key=lambda p: (-p[1], p[0]))[:n] if n else ()
        out.append(TokenLogprob(token, chosen[r], tuple(pairs)))
    return out


def record(seqs: list, logits: torch.Tensor, columns: list[list[int]]) -> None:
    """After a commit: append to each asking row (`seq.logprobs` not None) the entries of its
    tokens just emitted, the last len(columns[b]) of its token_ids, read at logits[b, columns[b]]
    (logits [B, W, V])."""
    rows = [b for b, seq in enumerate(seqs) if seq.logprobs is not None and columns[b]]
    if not rows:
        return
    b_index = torch.tensor([b for b in rows for _ in columns[b]], device=logits.device)
    c_index = torch.tensor([c for b in rows for c in columns[b]], device=logits.device)
    tokens, temperatures, tops = [], [], []
    for b in rows:
        seq, n = seqs[b], len(columns[b])
        tokens += seq.token_ids[len(seq.token_ids) - n :]
        temperatures += [seq.params.temperature] * n
        tops += [seq.params.logprobs] * n
    found = iter(entries(logits[b_index, c_index], tokens, temperatures, tops))
    for b in rows:
        seqs[b].logprobs.extend(next(found) for _ in columns[b])
