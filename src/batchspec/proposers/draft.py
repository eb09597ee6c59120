"""`DraftProposer`: a small causal LM with its own KV cache (role "draft" of the batch layout),
optionally with a reduced-vocabulary head (`vocab_ids` maps head index -> full-vocabulary id; a
`GrowingHead` learns its ids from every token the draft is fed), and drafting a tree (core/tree.py)
when `branches` has more than one node at some depth. Drafts follow each constrained row's
grammar: a chain's by the matcher advanced along it (grammar.DraftGuide), a tree's nodes by the
mask after each one's ancestry (grammar.TreeGuide); verification masks every column again."""

from __future__ import annotations

from functools import partial

import torch

from ..core import grammar
from ..core.sampling import RowParams, choose, greedy, probabilities
from ..core.tree import Tree, depth_widths, is_tree, limit_view
from ..layouts.base import Layout
from ..models.forward import forward
from ..models.vocab import GrowingHead
from .base import Proposal, Proposer, StopRule


class DraftProposer(Proposer):
    """Draft model proposer. Keeps its KV cache in the batch under role "draft". A draft's bin is
    its own probability under the draft model, in tenths (the draft's confidence)."""

    role = "draft"
    bins = 10
    rewinds = False  # forget the drafting forwards' cache entries after each proposal (a head's)

    def __init__(
        self,
        model,
        vocab_size: int,
        vocab_ids: torch.Tensor | GrowingHead | None = None,
        branches: int | tuple[int, ...] = 1,
    ):
        self.model = model
        self.branches = branches  # nodes per depth (C, or C_1, C_2, ..): more than 1 drafts a tree (tree.py)
        self.vocab_size = vocab_size  # the target's vocabulary (size of noise's last dim)
        self.growing = vocab_ids if isinstance(vocab_ids, GrowingHead) else None
        self._ids = None if self.growing is not None else vocab_ids
        self._index = None  # full id -> head index (-1: none), built when a tree first needs it

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[V_head] head index -> full id (a growing head's ids so far), or None for a full head."""
        return self.growing.ids if self.growing is not None else self._ids

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
        guide = grammar.DraftGuide(batch.seqs) if grammar.constrained(batch.seqs) else None
        try:
            for i in range(k):
                last = logits[:, -1] if guide is None else guide.mask(logits[:, -1], self.vocab_ids)
                token, confidence = self._pick(last, params, None if noise is None else noise[:, i])
                drafts.append(token)
                bins.append((confidence * self.bins).long().clamp(max=self.bins - 1))
                if i == k - 1 or (stop is not None and stop(i, torch.stack(bins, dim=1))):
                    break
                if guide is not None:
                    guide.advance(token)
                logits, carry = self._feed(batch, token[:, None], carry)
        finally:
            if guide is not None:
                guide.close()
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
        guide = grammar.TreeGuide(batch.seqs) if grammar.constrained(batch.seqs) else None
        for d in range(k):  # nodes of depth d + 1 from the logits of depth d's (the root's at d = 0)
            force = None if forced is None else (forced[0][:, d], forced[1] > d)
            c, depth_noise = widths[d], None if noise is None else noise[:, d]
            if guide is not None:
                logits = guide.mask(logits, self.vocab_ids)
            cum, beam, tokens, best = self._expand(cum, logits, params, depth_noise, force, c)
            if guide is not None:
                guide.grow(beam, tokens)
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
        if self._index is None or self.growing is not None:  # a growing head's ids change between calls
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

    def seen(self, ids: torch.Tensor) -> None:
        if self.growing is not None:
            self.growing.learn(ids)

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, q] to the draft's cache in `batch`; logits of the last column [B, 1, V_head]."""
        return self._feed(batch, ids)[0]

    def _feed(self, batch: Layout, ids: torch.Tensor, carry=None, view=None):
        """(logits of the last of ids [B, 1, V_head], what the next drafting forward needs besides
        its token: nothing for a draft model). `view` (a tree's nodes): it rewrites the inputs'
        mask and positions, and every column's logits come back [B, q, V_head]."""
        inputs = batch.inputs(self.role, ids.shape[1])
        self.seen(ids)
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
