"""One step of any method over any batch layout: prefill, or propose -> verify -> accept ->
commit -> realign.

A layout (`PaddedBatch`, `RaggedBatch`, the broken baselines' batches) is anything that meets the
`Layout` protocol (layouts/base.py); the step does not know how rows are stored. `k = 0` (no proposer) is plain
autoregressive decoding: the target's bonus token only.

Sampling parameters are per row (each Sequence's SamplingParams, stacked into `RowParams` every
step): a batch may mix greedy and sampled rows. An all-greedy batch takes the argmax path; in a
mixed batch greedy rows get one-hot distributions, so their pick is the argmax. Sampled rows pick
with the Gumbel noise of each token position under their seed (core/sampling.py): the target's pick at
every verified position is fixed by the row's seed and tokens, and the step keeps the drafts that
equal it, so a row's tokens depend on its seed alone, not on the batch it runs in or on how many
drafts were verified (policy/speculation.py chooses that). A row with a grammar (core/grammar.py)
picks among the tokens its grammar allows at each position: the target's logits are masked with
the grammar state after the drafts leading to each column, and drafts it refuses are cut first.

`Context.observe` sees every row right after its tokens are committed and before the batch
retires finished rows: the output processor (stop strings, streaming) finishes rows there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import kv
from ..core import acceptance, grammar, logprobs, tree
from ..core.sampling import RowParams, choose, greedy, probabilities, row_noise
from ..core.sequence import Sequence, Status
from ..core.stats import Stats
from ..distributed import tp
from ..layouts.base import Layout
from ..layouts.padded import PaddedBatch
from ..models.forward import Rider, carried
from ..models.pair import ModelPair
from ..policy.speculation import Fixed, Speculation, timed
from ..proposers.base import Proposal, Proposer
from .jump import forced_drafts
from .verify import accept, checked, masks, target_forward, verify


@dataclass
class Context:
    """What a method needs to run steps: models, parameters, and where to report."""

    target: torch.nn.Module
    proposer: Proposer | None
    k: int  # the most draft tokens a row verifies per step; 0 for plain decoding
    pad_id: int
    device: torch.device
    stats: Stats = field(default_factory=Stats)
    check: Callable | None = None  # invariant checker, called on the batch after each step
    on_finish: Callable[[list[Sequence]], None] = lambda seqs: None
    observe: Callable[[list[Sequence]], None] | None = None  # after commit, before retirement
    accept: Callable = acceptance.accept  # the acceptance rule (baselines.py plants a broken one)
    speculation: Speculation | None = None  # how many drafts per step; None: always k (Fixed)

    def __post_init__(self) -> None:
        if self.speculation is None:
            self.speculation = Fixed(self.k)

    @classmethod
    def of(cls, pair: ModelPair, proposer: Proposer | None, k: int, speculation: Speculation | None, **kw) -> Context:
        """The context of a decoder or a server over `pair`: its target, padding
        id and device; plain decoding (k = 0, no policy) without a proposer."""
        if proposer is None:
            k, speculation = 0, None
        return cls(pair.target, proposer, k, pair.pad_id, pair.device, speculation=speculation, **kw)

    @property
    def slots(self) -> int:
        """The most draft slots a row's verification writes: k, or a draft tree's nodes of k depths."""
        return tree.columns(1 if self.proposer is None else self.proposer.branches, self.k)

    @property
    def features(self):
        """The target's features the proposer reads (a proposers.Features), or None."""
        return None if self.proposer is None else self.proposer.features

    def models(self) -> dict:
        """Models that keep a cache, by role: the target, and the draft if the proposer has one."""
        out = {"target": self.target}
        if self.proposer is not None and self.proposer.role:
            out[self.proposer.role] = self.proposer.model
        return out

    @property
    def copies_target(self) -> bool:
        """The proposer's cache starts from the target's entries (`Proposer.kv_from_target`)."""
        return self.proposer is not None and self.proposer.kv_from_target

    def admitted_roles(self) -> list[str]:
        """Roles fed a prompt at admission into a layout that can `warm` a cache later (ragged):
        all of `models()`, less the proposer's when the policy is `lazy` (often drafts nothing) or
        when its cache starts from the target's entries (`kv_from_target`: warm copies them)."""
        later = self.speculation.lazy or self.copies_target
        return [role for role in self.models() if role == "target" or not later]


def start(ctx: Context, seqs: list[Sequence], batch_cls: type | None = None) -> Layout:
    """Mark `seqs` running, put them in a fresh padded batch (empty caches) and prefill it.
    Returns the batch, holding the rows that did not finish at once."""
    for seq in seqs:
        seq.status = Status.RUNNING
    caches = kv.empty_caches(ctx.models())
    batch = (batch_cls or PaddedBatch)(seqs, caches, ctx.pad_id, ctx.device)
    prefill(ctx, batch)
    return batch


def prefill(
    ctx: Context, batch: Layout, roles: list[str] | None = None, target_logits: torch.Tensor | None = None
) -> list[Sequence]:
    """Feed `roles` (default: every role) the rows' uncached tokens; the target's last logits give
    each row its first token. Returns the rows that finished (EOS first, or max_new_tokens == 1).
    `target_logits` [B, 1, V]: those logits where the target's cache holds the rows' prompts already
    (a chunk carried in a step's forward, admission.py); `roles` then lacks the target."""
    with ctx.stats.stage("prefill"):
        for role in ctx.models() if roles is None else roles:  # the target first
            if role != "target" and ctx.copies_target:  # its cache: a copy of the target's
                ctx.proposer.seen(batch.pending(role))
                batch.adopt(role, kv.entry_dtype(ctx.proposer.model))
                continue
            logits = feed(ctx, batch, role, batch.pending(role))  # [B, 1, V]
            if role == "target":
                target_logits = logits
        first = _first(target_logits[:, -1], batch.seqs)
        kept = [seq.commit([token]) for seq, token in zip(batch.seqs, first.tolist())]
        logprobs.record(batch.seqs, target_logits, [[0] * n for n in kept])
        ctx.stats.tokens += len(batch.seqs)
        if ctx.observe is not None:
            ctx.observe(batch.seqs)
        finished = batch.realign()
    _after(ctx, batch, finished)
    return finished


def feed(ctx: Context, batch: Layout, role: str, ids: torch.Tensor) -> torch.Tensor:
    """Feed ids [B, q] to `role`'s cache; logits of the last column [B, 1, V]. The target's
    features are kept when the proposer reads them (`proposer.features`, eagle.py)."""
    if role != "target":
        return ctx.proposer.feed(batch, ids)
    return target_forward(ctx.target, batch, ids, ctx.features, last_only=True)


def decode_step(ctx: Context, batch: Layout, rider: Rider | None = None) -> list[Sequence]:
    """One speculative (or plain) step for every row: plan -> propose -> verify -> accept ->
    commit -> realign; the policy chooses how many drafts to ask for and to verify. `rider`: a
    prompt chunk the verify may carry (admission.py; the policy learns the step less its share)."""
    stats, policy, seqs, span = ctx.stats, ctx.speculation, list(batch.seqs), batch.attended_span()
    params = RowParams.of([s.params for s in seqs], ctx.device)
    k, started = _plan(ctx, batch)
    noise = None if params.greedy else row_noise(seqs, k + 1, ctx.target.config.vocab_size, ctx.device)
    with stats.stage("draft"):
        proposal = _propose(ctx, batch, k, params, noise, started)
        drafts, limit = _chosen(policy, batch, proposal, started, ctx.device)
        limit = checked(seqs, drafts, limit)
        drafts, limit, learned, forced = forced_drafts(ctx, seqs, drafts, limit, proposal)
        if noise is not None and noise.shape[1] < drafts.shape[1] + 1:  # forced drafts reach further
            noise = row_noise(seqs, drafts.shape[1] + 1, ctx.target.config.vocab_size, ctx.device)
    step_start = timed(ctx.device)
    with stats.stage("verify"):
        verified = verify(ctx.target, batch, drafts, proposal, ctx.features, rider)
    with stats.stage("accept"):
        choice = _pick(
            grammar.apply(verified.logits, masks(seqs, verified, limit)),
            params,
            None if noise is None else noise[:, verified.offsets().to(noise.device)],
        )
        outcome, path = accept(batch, verified, choice, limit, ctx.accept, ctx.features)
        accepted = outcome.num_accepted.tolist()
        kept = [seq.commit(row, a) for seq, row, a in zip(seqs, outcome.rows(), accepted)]
        if any(seq.logprobs is not None for seq in seqs):  # cheap when no row asks
            logprobs.record(seqs, verified.logits, _columns(kept, accepted, path))
        stats.record_verified(seqs, kept, verified.width, limit)
        if forced is not None:
            stats.forced_tokens += int(torch.minimum(forced, outcome.num_accepted.cpu()).sum())
    if ctx.observe is not None:
        ctx.observe(seqs)
    with stats.stage("realign"):
        finished = batch.realign()
    step_s = _step_seconds(timed(ctx.device) - step_start, rider)
    policy.observe(seqs, learned, verified.width, accepted, step_start - started, step_s, span, carried(rider))
    _after(ctx, batch, finished)
    return finished


def _step_seconds(seconds: float, rider: Rider | None) -> float | None:
    """The verify's seconds as the policy learns them: less a carried rider's estimated share (None:
    not timed, a rider carried without an estimate or costing more than the whole)."""
    if not carried(rider):
        return seconds
    return seconds - rider.cost_s if rider.cost_s is not None and seconds > rider.cost_s else None


def _plan(ctx: Context, batch: Layout) -> tuple[int, float]:
    """(drafts to ask for this step, the step's start time). Choices from clocks are rank 0's on
    every tensor-parallel rank (tp.agree; a no-op otherwise). A layout that admitted rows while the
    policy drafted nothing feeds the proposer their tokens first (a prefill, not timed as a step)."""
    started = timed(ctx.device)
    k = tp.agree(ctx.speculation.plan(batch)) if ctx.proposer is not None and ctx.speculation.k_max > 0 else 0
    if k > 0 and ctx.proposer.role is not None:
        with ctx.stats.stage("prefill"):
            tokens = batch.warm(ctx.proposer)
            if tokens:
                fed, started = started, timed(ctx.device)
                ctx.speculation.warmed(tokens, started - fed)
    return k, started


def _propose(ctx: Context, batch: Layout, k: int, params: RowParams, noise, started: float) -> Proposal | None:
    """The proposer's drafts for this step (None for a plain step), drafting stopped early where the
    policy says (every rank agrees)."""
    if k == 0:
        return None
    rule = ctx.speculation.stop_rule(batch, started)
    stop = None if rule is None else (lambda i, bins: tp.agree(rule(i, bins)))
    return ctx.proposer.propose(batch, k, params, None if noise is None else noise[:, :k], stop)


def _chosen(policy, batch: Layout, proposal: Proposal | None, started: float, device):
    """The drafts to verify [B, w] and each row's count of real ones [B] (None: all w)."""
    if proposal is None:
        return torch.zeros(len(batch.seqs), 0, dtype=torch.long, device=device), None
    width = tp.agree(policy.choose(batch, proposal, started))
    limit = proposal.num_proposed
    if limit is not None:  # columns past a row's drafts are padding it never accepts
        limit = limit.clamp(max=width)
    return proposal.drafts[:, :width], limit


def _columns(kept: list[int], accepted: list[int], path: torch.Tensor | None) -> list[list[int]]:
    """Per row, the verified logits' column each kept token was picked at: a chain's 0..kept-1; a
    tree's root (0), then 1 + each accepted node of its path (path [B, k], node index by depth)."""
    if path is None:
        return [list(range(n)) for n in kept]
    nodes = path.tolist()
    return [([0] + [1 + node for node in nodes[b][:a]])[:n] for b, (n, a) in enumerate(zip(kept, accepted))]


def _after(ctx: Context, batch: Layout, finished: list[Sequence]) -> None:
    if ctx.check is not None and len(batch):
        ctx.check(batch)
    if finished:
        ctx.on_finish(finished)


def _first(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, V] -> each row's first token, picked under the noise of its next position."""
    params = RowParams.of([s.params for s in seqs], logits.device)
    noise = None if params.greedy else row_noise(seqs, 1, logits.shape[-1], logits.device)
    bits = grammar.chain_masks(seqs, [[] for _ in seqs])
    return _pick(grammar.apply(logits[:, None], bits), params, noise)[:, 0]


def _pick(logits: torch.Tensor, params: RowParams, noise: torch.Tensor | None) -> torch.Tensor:
    """logits [B, q, V] -> the target's pick at each column [B, q]: the argmax for greedy rows,
    else the pick under noise [B, q, V] (the Gumbel noise of each column's position)."""
    if noise is None:
        return greedy(logits)
    return choose(probabilities(logits, params), noise)
