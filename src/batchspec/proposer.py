"""Proposers: where draft tokens come from. They return draft ids, and for each a confidence bin
that adaptive speculation (speculation.py) learns acceptance rates by; acceptance lives in
`acceptance.py`.

- `DraftProposer`: a small causal LM with its own KV cache (role "draft" of the batch layout),
  optionally with a reduced-vocabulary head (`vocab_ids` maps head index -> full-vocabulary id).
- `EagleProposer`: a draft head that reads the target's own final hidden states (eagle.py), in
  the "draft" cache role; it has `features`, which the step fills from every target forward.
- `NgramProposer`: prompt lookup in the row's own tokens; no model, no cache (role None).
- `LookupFirst`: per row, prompt lookup where it found a match of at least `MIN_MATCH` tokens,
  else a model proposer's drafts (`--proposer ngram+eagle`, `ngram+draft`): lookup wins where the
  answer copies its prompt, the model on open-ended text.

A row may propose fewer than k tokens (`num_proposed`); positions beyond are never accepted, so a
row behaves exactly as if it had been asked for that many, whatever the rest of the batch does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .eagle import Features
from .sampling import RowParams, choose, greedy, probabilities
from .tree import Tree, depth_widths, is_tree, limit_view
from .verifier import forward

if TYPE_CHECKING:
    from .step import Layout


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, k] full-vocabulary ids
    num_proposed: torch.Tensor | None = None  # [B]; None means k for every row
    signal: torch.Tensor | None = None  # [B, k] long: each draft's confidence bin (0 .. proposer.bins - 1)
    forwards: int | None = None  # proposer calls it took; None: one per draft (a model), one (a lookup)
    tree: Tree | None = None  # a draft tree (tree.py) whose nodes hold `nodes`; drafts is one of its paths
    nodes: torch.Tensor | None = None  # [B, len(tree)] full-vocabulary ids


#: Called by a proposer that drafts step by step, after draft i (0-based) with the bins so far
#: [B, i + 1]; returning True ends drafting for the whole batch (adaptive speculation).
StopRule = Callable[[int, torch.Tensor], bool]


@runtime_checkable
class Proposer(Protocol):
    """What the step needs of a proposer. `role` names the cache it keeps in the batch layout
    (None: no model, no cache); `model` is that cache's model (None without one). `bins`: how many
    confidence bins its `Proposal.signal` uses (what adaptive speculation learns acceptance by).
    A proposer with a model also has `feed(batch, ids)` (prefill); one that reads the target's
    features has `features` (an eagle.Features, filled by every target forward of the step)."""

    role: str | None
    model: torch.nn.Module | None
    bins: int

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        """Up to k drafts per row of `batch` (a step.Layout). noise [B, k, V]: the Gumbel noise of
        the drafts' positions when sampling (sampling.py), else None."""
        ...


class DraftProposer:
    """Draft model proposer. Keeps its KV cache in the batch under role "draft". A draft's bin is
    its own probability under the draft model, in tenths (the draft's confidence)."""

    role = "draft"
    bins = 10
    rewinds = False  # forget the drafting forwards' cache entries after each proposal (a head's)

    def __init__(
        self, model, vocab_size: int, vocab_ids: torch.Tensor | None = None, branches: int | tuple[int, ...] = 1
    ):
        self.model = model
        self.branches = branches  # nodes per depth (C, or C_1, C_2, ..): more than 1 drafts a tree (tree.py)
        self.vocab_size = vocab_size  # the target's vocabulary (size of noise's last dim)
        self.vocab_ids = vocab_ids  # [V_head] head index -> full id, or None for a full head
        self._index = None  # full id -> head index (-1: none), built when a tree first needs it

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        """Up to k tokens per row with as many forwards: the pending tokens first, then each new
        draft but the last (whose KV is never needed unless all are accepted; see realign.py's
        lag). `stop` may end drafting early for the whole batch. With `branches` of more than one
        node at some depth (and a cache it rewinds) a tree instead (`_propose_tree`)."""
        if is_tree(self.branches) and self.rewinds:  # a kept cache would hold the chain's token, not a node's
            return self._propose_tree(batch, k, params, noise, stop)
        logits, carry = self._feed(batch, batch.pending(self.role))
        mark = batch.mark(self.role) if self.rewinds else None
        drafts, bins = [], []
        for i in range(k):
            token, confidence = self._pick(logits[:, -1], params, None if noise is None else noise[:, i])
            drafts.append(token)
            bins.append((confidence * self.bins).long().clamp(max=self.bins - 1))
            if i == k - 1 or (stop is not None and stop(i, torch.stack(bins, dim=1))):
                break
            logits, carry = self._feed(batch, token[:, None], carry)
        if self.rewinds:
            batch.rewind(self.role, mark)
        return Proposal(torch.stack(drafts, dim=1), signal=torch.stack(bins, dim=1))

    def _propose_tree(
        self,
        batch: Layout,
        k: int,
        params: RowParams,
        noise: torch.Tensor | None,
        stop: StopRule | None,
        forced: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Proposal:
        """A beam of C_d nodes at depth d (`branches`, `_expand`). Each depth's nodes are fed in one
        forward, each seeing the committed tokens and its own ancestors (and, for the head, its
        parent's predicted feature). `forced` (tokens [B, k], counts [B]): row b's first counts[b]
        depths start with those tokens (lookup first's chain). Drafts: the path to the best
        deepest node; bins: the model's best node's at each depth."""
        widths, role, b = depth_widths(self.branches, k), self.role, len(batch.seqs)
        logits, feats = self._feed(batch, batch.pending(role))
        mark = batch.mark(role)
        last = torch.tensor([len(s) - 1 for s in batch.seqs], device=logits.device)  # the roots' positions
        cum = torch.zeros(b, 1, device=logits.device)
        nodes, parents, beams, bins = [], [], [], []
        for d in range(k):  # nodes of depth d + 1 from the logits of depth d's (the root's at d = 0)
            force = None if forced is None else (forced[0][:, d], forced[1] > d)
            c, depth_noise = widths[d], None if noise is None else noise[:, d]
            cum, beam, tokens, best = self._expand(cum, logits, params, depth_noise, force, c)
            nodes.append(tokens)
            parents.append(beam - 1 if d == 0 else beam + sum(widths[: d - 1]))  # -1: the root
            beams.append(beam)
            bins.append((best * self.bins).long().clamp(max=self.bins - 1))
            if d == k - 1 or (stop is not None and stop(d, torch.stack(bins, dim=1))):
                break
            carry = None if feats is None else feats.gather(1, beam[:, :, None].expand(-1, -1, feats.shape[2]))
            at = (last + d + 1)[:, None].expand(b, c)  # the new nodes' positions
            visible = Tree(torch.cat(parents, dim=1), widths[: d + 1]).ancestry()[:, -c:]  # the new nodes' ancestors
            view = partial(limit_view, first=0, visible=visible, positions=at)
            logits, feats = self._feed(batch, tokens, carry, view)
        batch.rewind(role, mark)
        chain, slot = [], torch.zeros(b, 1, dtype=torch.long, device=last.device)
        for token, beam in zip(reversed(nodes), reversed(beams)):  # back from the best deepest node
            chain.append(token.gather(1, slot))
            slot = beam.gather(1, slot)
        tree = Tree(torch.cat(parents, dim=1), widths[: len(nodes)])
        drafts = torch.cat(chain[::-1], dim=1)
        return Proposal(drafts, signal=torch.stack(bins, dim=1), tree=tree, nodes=torch.cat(nodes, dim=1))

    def _expand(self, cum: torch.Tensor, logits: torch.Tensor, params: RowParams, noise, force, c: int):
        """One depth of the beam: cum [B, m] (the m fed nodes' cumulative scores), their logits
        [B, m, V_head] -> the C children with the best cumulative score among the C best of each
        node: (cum [B, C], parent among the m [B, C], full ids [B, C], the model's probability of its
        best child [B]). force (tokens [B], rows [B]) or None: those rows' first node is that token,
        a child of node 0, scored as certain (0), beside the C - 1 best others."""
        score, soft = self._scores(logits, params, noise)  # [B, m, V_head]
        top, idx = (cum[:, :, None] + score).topk(c, dim=-1)  # [B, m, c]: each node's c best children
        if force is not None:  # the forced token drafted by node 0 as well is the forced node itself
            token, rows = force
            top[:, 0] = top[:, 0].masked_fill(
                rows[:, None] & (idx[:, 0] == self._head_index(token)[:, None]), -torch.inf
            )
        cum, flat = top.flatten(1).topk(c, dim=1)  # [B, c], best first
        beam = torch.div(flat, c, rounding_mode="floor")
        picked = idx.flatten(1).gather(1, flat)
        best = soft.flatten(1).gather(1, beam[:, :1] * soft.shape[2] + picked[:, :1])[:, 0]
        tokens = self._to_full(picked)
        if force is not None:
            token, rows = force
            zero = torch.zeros_like(beam[:, :1])
            beam = torch.where(rows[:, None], torch.cat([zero, beam[:, :-1]], dim=1), beam)
            tokens = torch.where(rows[:, None], torch.cat([token[:, None], tokens[:, :-1]], dim=1), tokens)
            cum = torch.where(rows[:, None], torch.cat([zero.to(cum.dtype), cum[:, :-1]], dim=1), cum)
        return cum, beam, tokens, best

    def _head_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Full ids [B] -> the model's own vocabulary index (-1 where it has none)."""
        if self.vocab_ids is None:
            return ids
        if self._index is None:
            self._index = torch.full((self.vocab_size,), -1, dtype=torch.long, device=ids.device)
            self._index[self.vocab_ids.to(ids.device)] = torch.arange(len(self.vocab_ids), device=ids.device)
        return self._index[ids]

    def _scores(self, logits: torch.Tensor, params: RowParams, noise: torch.Tensor | None):
        """logits [B, m, V_head] -> (ranking scores, the confidence probabilities) [B, m, V_head]:
        log-softmax and softmax for a greedy row; for a sampled row log(sampling probs) plus the
        position's Gumbel noise (noise [B, V], the drafts a chain would sample), and those probs."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if noise is None:
            return logp, logp.exp()
        probs = probabilities(logits, params)
        greedy = (params.temperature.to(logits.device) == 0)[:, None, None]
        sampled = probs.log() + self._head_noise(noise)[:, None, :].to(probs.device)
        return torch.where(greedy, logp, sampled), torch.where(greedy, logp.exp(), probs)

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, q] to the draft's cache in `batch`; logits of the last column [B, 1, V_head]."""
        return self._feed(batch, ids)[0]

    def _feed(self, batch: Layout, ids: torch.Tensor, carry=None, view=None):
        """(logits of the last of ids [B, 1, V_head], what the next drafting forward needs besides
        its token: nothing for a draft model). `view` (a tree's nodes): it rewrites the inputs'
        mask and positions, and every column's logits come back [B, q, V_head]."""
        inputs = batch.inputs(self.role, ids.shape[1])
        if view is None:
            return forward(self.model, ids, inputs, last_only=True), None
        return forward(self.model, ids, view(inputs)), None

    def _pick(self, logits: torch.Tensor, params: RowParams, noise: torch.Tensor | None):
        """logits [B, V_head] -> (full ids [B], the draft's probability of each [B]: under its
        sampling distribution for a sampled row, its plain softmax for a greedy one)."""
        full = logits.float()  # converted once, for the softmax and the argmax
        soft = torch.softmax(full, dim=-1)
        if noise is None:
            idx = greedy(full)
        else:
            probs = probabilities(logits, params)
            idx = choose(probs, self._head_noise(noise))
            soft = torch.where(params.temperature.to(soft.device)[:, None] == 0, soft, probs)
        return self._to_full(idx), soft.gather(-1, idx[:, None]).squeeze(-1)

    def _head_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """noise [B, V] over the full vocabulary -> [B, V_head], the model's own ids' columns."""
        return noise if self.vocab_ids is None else noise[:, self.vocab_ids.to(noise.device)]

    def _to_full(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab_ids is None else self.vocab_ids[idx]


class EagleProposer(DraftProposer):
    """A feature-conditioned draft head (eagle.py) in the draft's cache role. It reads the target's
    features of the committed tokens (kept in `features` by every target forward), drafts from its
    own predicted features, then rewinds its cache to the committed tokens: accepted drafts are
    re-fed with the target's true features on the next step, so every cached entry is one the
    head computes from the tokens alone (what the invariant checker recomputes)."""

    rewinds = True

    def __init__(self, model, vocab_size: int, branches: int = 1):
        super().__init__(model, vocab_size, model.vocab_ids, branches)
        self.features = Features(model.feature_size, model.aux)

    def _feed(self, batch: Layout, ids: torch.Tensor, carry: torch.Tensor | None = None, view=None):
        """(logits [B, 1, V_head], predicted feature [B, 1, H]) of the last of ids [B, q]; the
        feature inputs are the target's (`carry` None, [B, q, F]) or the head's own previous
        predictions ([B, q, H], no aux blocks). `view` (a tree's nodes): it rewrites the inputs'
        mask and positions, and every column's logits and features come back."""
        inputs = batch.inputs(self.role, ids.shape[1])
        if carry is None:
            carry = self.features.read(batch.seqs, inputs["position_ids"], self.model.dtype)
        keep = 1 if view is None else ids.shape[1]
        inputs = inputs if view is None else view(inputs)
        out = self.model(input_ids=ids, features=carry, use_cache=True, logits_to_keep=keep, **inputs)
        return out.logits, out.hidden_states


#: `LookupFirst` takes a row's lookup drafts when they continue a match of at least this many tokens.
MIN_MATCH = 2


class LookupFirst:
    """Prompt lookup first, a model proposer where lookup has no match of `min_match` tokens.
    The model's cache is rewound after each proposal (as the head's always is): rows that take the
    lookup's drafts leave no entries of the model's own drafts behind, and accepted tokens are fed
    to the model on the next step. Bins: the model's (0 .. model.bins - 1), then model.bins + the
    lookup's match length. In a chain the model is not called when every row takes the lookup's
    drafts. In a draft tree a lookup row's first node at each depth is the
    lookup's draft, beside the model's C_d - 1 best others, children of the lookup's nodes among
    them (the model drafts from the lookup's chain too, which its beam ranks as certain): so the
    model's guesses count where the lookup's break, and continue it past its end."""

    def __init__(self, model_proposer: DraftProposer, lookup: NgramProposer, min_match: int = MIN_MATCH):
        model_proposer.rewinds = True
        self.inner, self.lookup, self.min_match = model_proposer, lookup, min_match
        self.role, self.model = model_proposer.role, model_proposer.model
        self.branches = model_proposer.branches
        self.bins = model_proposer.bins + lookup.bins
        if hasattr(model_proposer, "features"):
            self.features = model_proposer.features

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.feed(batch, ids)

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        found = self.lookup.propose(batch, k, params, noise)
        take = (found.num_proposed > 0) & (found.signal[:, 0] >= self.min_match)  # [B] rows that take lookup's
        if bool(take.all()) and not is_tree(self.branches):
            return Proposal(found.drafts, found.num_proposed, found.signal + self.inner.bins, forwards=0)
        mine = torch.where(take[:, None], found.signal + self.inner.bins, 0)  # [B, k]

        def merged_stop(i: int, bins: torch.Tensor) -> bool:  # the policy sees each row's own source
            return stop(i, torch.where(take[:, None], mine[:, : i + 1], bins))

        merged = None if stop is None else merged_stop
        if is_tree(self.branches):  # a tree: the lookup chain first where a row takes it, the model's beam beside
            counts = torch.where(take, found.num_proposed, 0)
            drafted = self.inner._propose_tree(batch, k, params, noise, merged, (found.drafts, counts))
            signal = torch.where(take[:, None], mine[:, : drafted.drafts.shape[1]], drafted.signal)
            return Proposal(drafted.drafts, None, signal, tree=drafted.tree, nodes=drafted.nodes)
        drafted = self.inner.propose(batch, k, params, noise, merged)
        j = drafted.drafts.shape[1]
        counts = torch.where(take, found.num_proposed.clamp(max=j), j)
        drafts = torch.where(take[:, None], found.drafts[:, :j], drafted.drafts)
        signal = torch.where(take[:, None], mine[:, :j], drafted.signal)
        return Proposal(drafts, counts, signal)


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the row's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it. No model, no cache. A draft's
    bin is the length n of the match that proposed it."""

    role = None
    model = None

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self.bins = max_n + 1
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        found = []
        for seq in batch.seqs:
            index = self.indexes.get(seq)
            if index is None:
                index = self.indexes[seq] = NgramIndex(self.max_n, self.min_n)
            found.append(index.lookup(seq.token_ids, k))
        device = batch.device
        counts = torch.tensor([len(r) for r, _ in found], device=device)
        drafts = torch.tensor([r + [0] * (k - len(r)) for r, _ in found], dtype=torch.long, device=device)
        signal = torch.tensor([[n] * k for _, n in found], dtype=torch.long, device=device)
        return Proposal(drafts, counts, signal)


class NgramIndex:
    """`lookup_match` in O(k + max_n) per call over a growing token list: for each n, the latest
    start of every n-gram that has a follower, updated with the tokens added since the last call.
    Valid because a sequence's tokens only ever grow."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.done = 0  # n-grams starting before ... are indexed once they have a follower

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        length = len(tokens)
        for n, table in self.last.items():  # n-grams at start s need s + n <= length - 1
            for start in range(max(0, self.done - n), length - n):
                table[tuple(tokens[start : start + n])] = start
        self.done = length
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.last[n].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + k], n
        return [], 0


def lookup(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens[-n:], trying the
    longest n first; [] when nothing matches."""
    return lookup_match(tokens, k, max_n, min_n)[0]


def lookup_match(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> tuple[list[int], int]:
    """`lookup`, and the length n of the suffix that matched (0 when nothing did)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first, excluding the suffix itself
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow, n
    return [], 0
