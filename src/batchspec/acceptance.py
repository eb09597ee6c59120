"""Acceptance: which draft tokens a row keeps, and the one token the target adds.

Pure, batched tensor functions; no models. Vocabulary: `drafts` [B, k] are the proposer's tokens;
`num_accepted` [B] counts the agreeing prefix; at the first rejection the target supplies the
**recovered** token, and when all k are accepted it supplies the **bonus** token. The output of
row b is `tokens[b, : num_accepted[b] + 1]` (1..k+1 tokens). k may be 0 (plain decoding: the
bonus token only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


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


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor, limit: torch.Tensor | None = None) -> Outcome:
    """drafts [B, k], target_logits [B, k+1, V], limit [B] (drafts actually proposed) -> Outcome.

    Accept while the draft equals the target's argmax; the target's argmax at the first mismatch
    (or at position k) is the recovered (or bonus) token. Since accepted drafts equal the target's
    argmax, the output is simply the target's argmax prefix.
    """
    choice = target_logits.argmax(dim=-1)  # [B, k+1]
    num_accepted = _cap(accepted_prefix(drafts == choice[:, :-1]), limit)
    return Outcome(tokens=choice, num_accepted=num_accepted)


def rejection_sample(
    drafts: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    u_accept: torch.Tensor,  # [B, k] uniforms in [0, 1)
    u_final: torch.Tensor,  # [B] uniforms in [0, 1)
    limit: torch.Tensor | None = None,  # [B] drafts actually proposed (draft_probs 0 beyond)
) -> Outcome:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    Draft token i is accepted with probability min(1, target/draft), tested as
    u * draft < target (no division, so a zero draft probability is safe). At the first rejection
    the recovered token is drawn from the normalised residual max(0, target - draft); if that
    residual has no mass (only possible through rounding) the target distribution is used. If all
    k pass, the bonus token is drawn from the target at position k. The output then follows the
    target distribution exactly, whatever the draft.
    """
    batch, k = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    p_target = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()
    p_draft = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).double()
    accept = u_accept.to(p_target.device) * p_draft < p_target
    num_accepted = _cap(accepted_prefix(accept), limit)  # [B]

    final_target = target_probs[rows, num_accepted].double()  # [B, V]
    residual = (final_target - _pad_draft(draft_probs)[rows, num_accepted].double()).clamp(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    rejected = (num_accepted < k)[:, None]
    final_dist = torch.where(rejected & ~empty, residual, final_target)
    final = sample(final_dist, u_final)

    tokens = torch.cat([drafts, final[:, None]], dim=1)
    tokens[rows, num_accepted] = final
    return Outcome(tokens=tokens, num_accepted=num_accepted)


def _pad_draft(draft_probs: torch.Tensor) -> torch.Tensor:
    """[B, k, V] -> [B, k+1, V] with zeros at position k (no draft there: the bonus position)."""
    return torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))


def _cap(num_accepted: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    return num_accepted if limit is None else torch.minimum(num_accepted, limit.to(num_accepted.device))


def accept(drafts, target_logits, draft_probs, target_probs, u_accept, u_final, limit) -> Outcome:
    """The standard rule: greedy when `target_probs` is None, else rejection sampling."""
    if target_probs is None:
        return greedy_accept(drafts, target_logits, limit)
    return rejection_sample(drafts, draft_probs, target_probs, u_accept, u_final, limit)
