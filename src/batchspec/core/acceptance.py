"""Acceptance: which draft tokens a row keeps, and the one token the target adds.

Pure, batched tensor functions; no models. `drafts` [B, k] are the proposer's tokens; `choice`
[B, k+1] is the target's own pick after `[last, d1..dk]` (the argmax when greedy; with sampling,
the Gumbel-max pick under the row's position-keyed noise, sampling.py). A draft is kept while it
equals the target's pick; at the first mismatch the target's pick is the **recovered** token, and
when all k are kept its pick at position k is the **bonus** token. So a row's output is the
target's own prefix `choice[b, : num_accepted[b] + 1]` (1..k+1 tokens), whatever the drafts were:
speculation changes how many tokens a step yields, never which. k may be 0 (plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Outcome:
    """tokens [B, k+1]: row b's output is tokens[b, : num_accepted[b] + 1]. num_accepted [B]."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def rows(self) -> list[list[int]]:
        """Each row's output tokens as a Python list (one device sync for the whole batch)."""
        tokens, counts = self.tokens.tolist(), self.num_accepted.tolist()
        return [row[: n + 1] for row, n in zip(tokens, counts)]


def accepted_prefix(matches: torch.Tensor) -> torch.Tensor:
    """matches [B, k] bool -> length of the all-True prefix of each row [B]."""
    return matches.long().cumprod(dim=-1).sum(dim=-1)


def accept(drafts: torch.Tensor, choice: torch.Tensor, limit: torch.Tensor | None = None) -> Outcome:
    """drafts [B, k], choice [B, k+1], limit [B] (drafts actually proposed; None: k) -> Outcome.

    Keep drafts while they equal the target's pick (at most `limit` of them); the output is the
    target's picks up to and including the first one not matched by a kept draft."""
    num_accepted = accepted_prefix(drafts == choice[:, :-1])
    if limit is not None:
        num_accepted = torch.minimum(num_accepted, limit.to(num_accepted.device))
    return Outcome(tokens=choice, num_accepted=num_accepted)
