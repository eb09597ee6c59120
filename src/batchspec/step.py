"""One step of any method over any batch layout: prefill, or propose -> verify -> accept ->
commit -> realign.

A layout (`PaddedBatch`, `RaggedBatch`, the broken baselines' batches) is anything that meets the
`Layout` protocol; the step does not know how rows are stored. `k = 0` (no proposer) is plain
autoregressive decoding: the target's bonus token only.

Sampling parameters are per row (each Sequence's SamplingParams, stacked into `RowParams` every
step): a batch may mix greedy and sampled rows. An all-greedy batch takes the argmax path; in a
mixed batch greedy rows get one-hot distributions, so their pick is the argmax. Sampled rows pick
with the Gumbel noise of each token position under their seed (sampling.py): the target's pick at
every verified position is fixed by the row's seed and tokens, and the step keeps the drafts that
equal it, so a row's tokens depend on its seed alone, not on the batch it runs in or on how many
drafts were verified (speculation.py chooses that).

`Context.observe` sees every row right after its tokens are committed and before the batch
retires finished rows: the output processor (stop strings, streaming) finishes rows there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from . import acceptance, kv, logprobs, tp, tree
from .batch import PaddedBatch
from .proposer import Proposal, Proposer
from .sampling import RowParams, choose, greedy, probabilities, row_noise
from .sequence import Sequence, Status
from .speculation import Fixed, Speculation, attended_span, timed
from .stats import Stats
from .verifier import settle, target_forward, verify, verify_tree


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

    def mark(self, role: str) -> object:
        """An opaque point in `role`'s cache that `rewind` returns to."""
        ...

    def rewind(self, role: str, mark: object) -> None:
        """Forget the entries `role` was fed since `mark` (a draft head's drafting forwards)."""
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

    # Optional: `keep_path(role, nodes, index)`, after a draft tree's forward, moves each row's
    # accepted path to the first k node slots (tree.py); a layout without it verifies chains only.


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

    @property
    def slots(self) -> int:
        """The most draft slots a row's verification writes: k, or a draft tree's nodes of k depths."""
        return tree.columns(getattr(self.proposer, "branches", 1), self.k)

    def models(self) -> dict:
        """Models that keep a cache, by role: the target, and the draft if the proposer has one."""
        out = {"target": self.target}
        if self.proposer is not None and self.proposer.role:
            out[self.proposer.role] = self.proposer.model
        return out

    def admitted_roles(self) -> list[str]:
        """Roles fed a prompt at admission into a layout that can `warm` a cache later (ragged):
        all of `models()`, less the proposer's when the policy is `lazy` (often drafts nothing)."""
        lazy = self.speculation.lazy
        return [role for role in self.models() if role == "target" or not lazy]


def start(ctx: Context, seqs: list[Sequence], batch_cls: type | None = None) -> Layout:
    """Mark `seqs` running, put them in a fresh padded batch (empty caches) and prefill it.
    Returns the batch, holding the rows that did not finish at once."""
    for seq in seqs:
        seq.status = Status.RUNNING
    caches = {role: kv.empty(model.config) for role, model in ctx.models().items()}
    batch = (batch_cls or PaddedBatch)(seqs, caches, ctx.pad_id, ctx.device)
    prefill(ctx, batch)
    return batch


def prefill(ctx: Context, batch: Layout, roles: list[str] | None = None) -> list[Sequence]:
    """Feed `roles` (default: every role) the rows' uncached tokens; the target's last logits give
    each row its first token. Returns the rows that finished (EOS first, or max_new_tokens == 1)."""
    with ctx.stats.stage("prefill"):
        target_logits = None
        for role in ctx.models() if roles is None else roles:
            logits = feed(ctx, batch, role, batch.pending(role))  # [B, 1, V]
            if role == "target":
                target_logits = logits
        first = _pick(target_logits[:, -1], batch.seqs)
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
    return target_forward(ctx.target, batch, ids, getattr(ctx.proposer, "features", None), last_only=True)


def decode_step(ctx: Context, batch: Layout) -> list[Sequence]:
    """One speculative (or plain) step for every row; the speculation policy chooses how many
    drafts to ask for and how many to verify. Returns the finished rows."""
    stats, policy = ctx.stats, ctx.speculation
    seqs, span = list(batch.seqs), attended_span(batch)
    params = RowParams.of([s.params for s in seqs], ctx.device)
    started = timed(ctx.device)
    # Choices from clocks are rank 0's on every tensor-parallel rank (tp.agree; a no-op otherwise).
    k = tp.agree(policy.plan(batch)) if ctx.proposer is not None and policy.k_max > 0 else 0
    warm = getattr(batch, "warm", None)
    if k > 0 and warm is not None and ctx.proposer.role is not None:
        with stats.stage("prefill"):  # rows admitted while the policy did not draft (lazy)
            if warm(ctx.proposer):
                started = timed(ctx.device)
    vocab = ctx.target.config.vocab_size
    noise = None if params.greedy else row_noise(seqs, k + 1, vocab, ctx.device)
    with stats.stage("draft"):
        proposal = None
        if k > 0:
            rule = policy.stop_rule(batch, started)
            stop = None if rule is None else (lambda i, bins: tp.agree(rule(i, bins)))
            proposal = ctx.proposer.propose(batch, k, params, None if noise is None else noise[:, :k], stop)
        drafts, limit = _chosen(policy, batch, proposal, started, ctx.device)
    step_start = timed(ctx.device)
    features = getattr(ctx.proposer, "features", None)
    shape, nodes = _tree(proposal, batch, drafts.shape[1])
    with stats.stage("verify"):
        if shape is None:
            logits = verify(ctx.target, batch, drafts, features)
        else:
            logits, fed = verify_tree(ctx.target, batch, nodes, shape, features)
    with stats.stage("accept"):
        width = drafts.shape[1]
        offsets = torch.arange(width + 1) if shape is None else torch.nn.functional.pad(shape.depth().cpu(), (1, 0))
        if params.greedy:
            choice = greedy(logits)
        else:  # noise by position: a tree's node at depth d reads offset d
            choice = choose(probabilities(logits, params), noise[:, offsets.to(noise.device)])
        if shape is None:
            outcome = ctx.accept(drafts, choice, limit)
        else:
            outcome, path = tree.accept(nodes, shape, choice, limit)
            settle(batch, fed, path, features)
        rows, accepted = outcome.rows(), outcome.num_accepted.tolist()
        kept = [seq.commit(row, a) for seq, row, a in zip(seqs, rows, accepted)]
        if any(seq.logprobs is not None for seq in seqs):
            logprobs.record(seqs, logits, _columns(kept, accepted, None if shape is None else path))
        stats.record_step(kept, [seq.accepted_per_step[-1] for seq in seqs])
        offered = [width] * len(seqs) if limit is None else limit.tolist()
        for seq, n in zip(seqs, offered):
            seq.proposed_drafts += n
        stats.proposed_drafts += sum(offered)
        stats.chosen_k.update(offered)
    if ctx.observe is not None:
        ctx.observe(seqs)
    with stats.stage("realign"):
        finished = batch.realign()
    done = timed(ctx.device)
    policy.observe(seqs, proposal, width, accepted, step_start - started, done - step_start, span)
    _after(ctx, batch, finished)
    return finished


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


def _tree(proposal: Proposal | None, batch: Layout, width: int):
    """(the draft tree to verify, its nodes [B, width x C]): the proposal's tree cut at depth
    `width`, where the proposer drafted one and the layout can keep a tree's path; else (None, None)."""
    if proposal is None or proposal.tree is None or width == 0 or not hasattr(batch, "keep_path"):
        return None, None
    shape = proposal.tree.cut(width)
    return shape, proposal.nodes[:, : len(shape)]


def _after(ctx: Context, batch: Layout, finished: list[Sequence]) -> None:
    if ctx.check is not None and len(batch):
        ctx.check(batch)
    if finished:
        ctx.on_finish(finished)


def _pick(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, V] -> one token per row: the argmax for greedy rows, else the pick under the
    noise of the row's next position."""
    params = RowParams.of([s.params for s in seqs], logits.device)
    if params.greedy:
        return greedy(logits)
    return choose(probabilities(logits, params), row_noise(seqs, 1, logits.shape[-1], logits.device)[:, 0])
