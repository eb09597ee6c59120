"""One step of any method over any batch layout: prefill, or propose -> verify -> accept ->
commit -> realign.

A layout (`PaddedBatch`, `RaggedBatch`, the broken baselines' batches) is anything that meets the
`Layout` protocol; the step does not know how rows are stored. `k = 0` (no proposer) is plain
autoregressive decoding: the target's bonus token only.

Sampling parameters are per row (each Sequence's SamplingParams, stacked into `RowParams` every
step): a batch may mix greedy and sampled rows. An all-greedy batch takes the argmax path; in a
mixed batch greedy rows get one-hot distributions, for which rejection sampling is greedy
acceptance. Randomness: each sampled row draws 2k+1 uniforms per step from its own generator (k
for the draft's samples, k for the acceptance tests, 1 for the recovered/bonus token) and 1 at
prefill, so a row's tokens depend on its seed alone, not on the batch it runs in.

`Context.observe` sees every row right after its tokens are committed and before the batch
retires finished rows: the output processor (stop strings, streaming) finishes rows there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from . import acceptance, kv
from .batch import PaddedBatch
from .proposer import Proposal, Proposer
from .sampling import RowParams, draw_uniforms, probabilities, sample
from .sequence import Sequence, Status
from .stats import Stats
from .verifier import forward, verify


@runtime_checkable
class Layout(Protocol):
    """What a step needs of a batch layout. Roles are "target" and the proposer's cache role."""

    seqs: list[Sequence]  # the running rows, in row order
    device: torch.device

    def __len__(self) -> int: ...

    def pending(self, role: str) -> torch.Tensor:
        """ids [B, q]: the committed tokens `role` has not cached yet (q >= 1)."""
        ...

    def inputs(self, role: str, q: int) -> dict:
        """Model kwargs (attention_mask, position_ids, cache) to feed q new tokens per row."""
        ...

    def realign(self) -> list[Sequence]:
        """After tokens were committed: restore the layout's invariants, drop finished rows."""
        ...

    def cached_counts(self, role: str) -> list[int]:
        """Real entries of each row in `role`'s cache (for the invariant checker)."""
        ...

    def row_cache(self, role: str, row: int) -> kv.SeqKV:
        """Row `row`'s real entries of `role`'s cache, oldest first."""
        ...

    def check_layout(self) -> None:
        """Assert the layout's structural invariants."""
        ...


@dataclass
class Context:
    """What a method needs to run steps: models, parameters, and where to report."""

    target: torch.nn.Module
    proposer: Proposer | None
    k: int  # draft tokens per step; 0 for plain decoding
    pad_id: int
    device: torch.device
    stats: Stats = field(default_factory=Stats)
    check: Callable | None = None  # invariant checker, called on the batch after each step
    on_finish: Callable[[list[Sequence]], None] = lambda seqs: None
    observe: Callable[[list[Sequence]], None] | None = None  # after commit, before retirement
    accept: Callable = acceptance.accept  # the acceptance rule (baselines.py plants a broken one)

    def models(self) -> dict:
        """Models that keep a cache, by role: the target, and the draft if the proposer has one."""
        out = {"target": self.target}
        if self.proposer is not None and self.proposer.role:
            out[self.proposer.role] = self.proposer.model
        return out


def start(ctx: Context, seqs: list[Sequence], batch_cls: type | None = None) -> Layout:
    """Mark `seqs` running, put them in a fresh padded batch (empty caches) and prefill it.
    Returns the batch, holding the rows that did not finish at once."""
    for seq in seqs:
        seq.status = Status.RUNNING
    caches = {role: kv.empty(model.config) for role, model in ctx.models().items()}
    batch = (batch_cls or PaddedBatch)(seqs, caches, ctx.pad_id, ctx.device)
    prefill(ctx, batch)
    return batch


def prefill(ctx: Context, batch: Layout) -> list[Sequence]:
    """Feed every role the rows' uncached tokens; the target's last logits give each row its
    first token. Returns the rows that finished (EOS first, or max_new_tokens == 1)."""
    with ctx.stats.stage("prefill"):
        first = None
        for role, model in ctx.models().items():
            ids = batch.pending(role)
            logits = forward(model, ids, batch.inputs(role, ids.shape[1]), last_only=True)[:, -1]
            if role == "target":
                first = _pick(logits, batch.seqs)
        for seq, token in zip(batch.seqs, first.tolist()):
            seq.commit([token])
        ctx.stats.tokens += len(batch.seqs)
        if ctx.observe is not None:
            ctx.observe(batch.seqs)
        finished = batch.realign()
    _after(ctx, batch, finished)
    return finished


def decode_step(ctx: Context, batch: Layout) -> list[Sequence]:
    """One speculative (or, with k = 0, plain) step for every row. Returns the finished rows."""
    k, stats = ctx.k, ctx.stats
    params = RowParams.of([s.params for s in batch.seqs], ctx.device)
    u = None if params.greedy else draw_uniforms([s.generator for s in batch.seqs], 2 * k + 1)
    with stats.stage("draft"):
        proposal = _propose(ctx, batch, params, u)
    drafts, limit = proposal.drafts, proposal.num_proposed
    with stats.stage("verify"):
        logits = verify(ctx.target, batch, drafts)
    with stats.stage("accept"):
        k_eff = drafts.shape[1]
        if params.greedy:
            outcome = ctx.accept(drafts, logits, None, None, None, None, limit)
        else:
            target_probs = probabilities(logits, params)
            outcome = ctx.accept(
                drafts, logits, proposal.draft_probs, target_probs, u[:, k : k + k_eff], u[:, 2 * k], limit
            )
        rows, accepted = outcome.rows(), outcome.num_accepted.tolist()
        kept = [seq.commit(row, a) for seq, row, a in zip(batch.seqs, rows, accepted)]
        stats.record_step(kept, [seq.accepted_per_step[-1] for seq in batch.seqs])
        offered = [k_eff] * len(batch.seqs) if limit is None else limit.tolist()
        for seq, n in zip(batch.seqs, offered):
            seq.proposed_drafts += n
        stats.proposed_drafts += sum(offered)
    if ctx.observe is not None:
        ctx.observe(batch.seqs)
    with stats.stage("realign"):
        finished = batch.realign()
    _after(ctx, batch, finished)
    return finished


def _after(ctx: Context, batch: Layout, finished: list[Sequence]) -> None:
    if ctx.check is not None and len(batch):
        ctx.check(batch)
    if finished:
        ctx.on_finish(finished)


def _propose(ctx: Context, batch: Layout, params: RowParams, u: torch.Tensor | None) -> Proposal:
    n = len(batch.seqs)
    if ctx.k == 0 or ctx.proposer is None:
        empty = torch.zeros(n, 0, dtype=torch.long, device=ctx.device)
        probs = None if params.greedy else torch.zeros(n, 0, ctx.target.config.vocab_size, device=ctx.device)
        return Proposal(empty, probs)
    proposal = ctx.proposer.propose(batch, ctx.k, params, None if u is None else u[:, : ctx.k])
    if proposal.num_proposed is not None:  # drop columns no row uses; each row is unaffected
        k_eff = int(proposal.num_proposed.max())
        probs = proposal.draft_probs
        proposal = Proposal(
            proposal.drafts[:, :k_eff], None if probs is None else probs[:, :k_eff], proposal.num_proposed
        )
    return proposal


def _pick(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, V] -> one token per row: argmax for greedy rows, else a sample with one uniform
    per sampled row."""
    params = RowParams.of([s.params for s in seqs], logits.device)
    if params.greedy:
        return logits.argmax(dim=-1)
    u = draw_uniforms([s.generator for s in seqs], 1)[:, 0]
    return sample(probabilities(logits, params), u)
