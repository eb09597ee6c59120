"""Jump-forward: where a constrained row's grammar allows exactly one token next (a schema's fixed
keys and punctuation), that token is a draft that costs no model call and is always kept: the
masked target has no other pick. A step verifies a row's forced run in place of its proposer's
drafts when the run is longer than the drafts the grammar allows (`verify.checked`).

Drafts are replaced only where the proposer keeps none of them in its cache (a lookup, a model
that rewinds after each proposal), or where it proposed nothing this step; a chain drafted by a
draft model that keeps its cache already starts with the forced tokens (grammar.DraftGuide masks
it), and trees are left as they are.
"""

from __future__ import annotations

import torch

from ..core import grammar
from ..proposers.base import Proposal


def forced_drafts(ctx, seqs: list, drafts: torch.Tensor, limit: torch.Tensor | None, proposal: Proposal | None):
    """drafts [B, w], limit [B] or None -> (drafts [B, w'], limit [B] or None, the proposal the
    policy learns from, forced tokens per row [B] (None: none)). A replaced row's proposal counts
    as offering nothing, so forced tokens do not teach the policy its proposer's acceptance."""
    if ctx.k == 0 or not grammar.constrained(seqs):
        return drafts, limit, proposal, None
    if proposal is not None and (proposal.tree is not None or not _keeps_no_drafts(ctx.proposer)):
        return drafts, limit, proposal, None
    counts = [drafts.shape[1]] * len(seqs) if limit is None else limit.tolist()
    runs = [[] if seq.matcher is None else seq.matcher.forced(ctx.k) for seq in seqs]
    if all(len(run) <= n for run, n in zip(runs, counts)):
        return drafts, limit, proposal, None
    width = max(drafts.shape[1], *(len(run) for run in runs))
    out = torch.nn.functional.pad(drafts, (0, width - drafts.shape[1]), value=ctx.pad_id)
    forced = [0] * len(seqs)
    for b, (run, n) in enumerate(zip(runs, counts)):
        if len(run) > n:
            out[b, : len(run)] = torch.tensor(run, dtype=out.dtype)
            counts[b] = forced[b] = len(run)
    new_limit = torch.tensor(counts, dtype=torch.long, device=drafts.device)
    return out, new_limit, _without(proposal, forced, width), torch.tensor(forced)


def _keeps_no_drafts(proposer) -> bool:
    """The proposer's cache holds none of its drafts after proposing (so they may be replaced)."""
    return proposer.role is None or proposer.rewinds


def _without(proposal: Proposal | None, forced: list[int], width: int) -> Proposal | None:
    """The proposal as the policy should learn from it: replaced rows offered nothing; widened to
    `width` columns."""
    if proposal is None:
        return None
    b, w = proposal.drafts.shape
    offered = torch.full((b,), w) if proposal.num_proposed is None else proposal.num_proposed.cpu()
    offered = torch.where(torch.tensor(forced) > 0, 0, offered)
    pad = (0, width - w)
    signal = None if proposal.signal is None else torch.nn.functional.pad(proposal.signal, pad)
    return Proposal(torch.nn.functional.pad(proposal.drafts, pad), offered, signal, proposal.forwards)
