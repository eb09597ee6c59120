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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .eagle import Features
from .sampling import RowParams, choose, probabilities
from .verifier import forward

if TYPE_CHECKING:
    from .step import Layout


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, k] full-vocabulary ids
    num_proposed: torch.Tensor | None = None  # [B]; None means k for every row
    signal: torch.Tensor | None = None  # [B, k] long: each draft's confidence bin (0 .. proposer.bins - 1)
    forwards: int | None = None  # proposer calls it took; None: one per draft (a model), one (a lookup)
    alternatives: torch.Tensor | None = None  # [B, k, c-1]: next-best tokens at each depth (tree.py)


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

    def __init__(self, model, vocab_size: int, vocab_ids: torch.Tensor | None = None, branches: int = 1):
        self.model = model
        self.branches = branches  # candidates per depth: > 1 offers c - 1 alternatives (a tree)
        self.vocab_size = vocab_size  # the target's vocabulary (size of noise's last dim)
        self.vocab_ids = vocab_ids  # [V_head] head index -> full id, or None for a full head

    def propose(
        self, batch: Layout, k: int, params: RowParams, noise: torch.Tensor | None, stop: StopRule | None = None
    ) -> Proposal:
        """Up to k tokens per row with as many forwards: the pending tokens first, then each new
        draft but the last (whose KV is never needed unless all are accepted; see realign.py's
        lag). `stop` may end drafting early for the whole batch."""
        logits, carry = self._feed(batch, batch.pending(self.role))
        mark = batch.mark(self.role) if self.rewinds else None
        drafts, bins, others = [], [], []
        tree = self.branches > 1 and self.rewinds  # a kept cache would hold the chain's token, not a leaf's
        for i in range(k):
            token, confidence = self._pick(logits[:, -1], params, None if noise is None else noise[:, i])
            drafts.append(token)
            bins.append((confidence * self.bins).long().clamp(max=self.bins - 1))
            if tree:
                others.append(self._alternatives(logits[:, -1], token))
            if i == k - 1 or (stop is not None and stop(i, torch.stack(bins, dim=1))):
                break
            logits, carry = self._feed(batch, token[:, None], carry)
        if self.rewinds:
            batch.rewind(self.role, mark)
        alternatives = torch.stack(others, dim=1) if tree else None
        return Proposal(torch.stack(drafts, dim=1), signal=torch.stack(bins, dim=1), alternatives=alternatives)

    def _alternatives(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """logits [B, V_head], the drafted tokens [B] -> the c - 1 most likely other tokens [B, c-1]
        (full ids, best first)."""
        c = self.branches
        top = self._to_full(logits.topk(min(c, logits.shape[-1]), dim=-1).indices)  # [B, c]
        other = top != token[:, None]
        order = torch.argsort((~other).int(), dim=1, stable=True)[:, : c - 1]  # the drafted one last
        return top.gather(1, order)

    def feed(self, batch: Layout, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids [B, q] to the draft's cache in `batch`; logits of the last column [B, 1, V_head]."""
        return self._feed(batch, ids)[0]

    def _feed(self, batch: Layout, ids: torch.Tensor, carry=None):
        """(logits of the last of ids [B, 1, V_head], what the next drafting forward needs besides
        its token: nothing for a draft model)."""
        return forward(self.model, ids, batch.inputs(self.role, ids.shape[1]), last_only=True), None

    def _pick(self, logits: torch.Tensor, params: RowParams, noise: torch.Tensor | None):
        """logits [B, V_head] -> (full ids [B], the draft's probability of each [B]: under its
        sampling distribution for a sampled row, its plain softmax for a greedy one)."""
        soft = torch.softmax(logits.float(), dim=-1)
        if noise is None:
            idx = logits.argmax(dim=-1)
        else:
            probs = probabilities(logits, params)
            head_noise = noise if self.vocab_ids is None else noise[:, self.vocab_ids.to(noise.device)]
            idx = choose(probs, head_noise)
            soft = torch.where(params.temperature.to(soft.device)[:, None] == 0, soft, probs)
        return self._to_full(idx), soft.gather(-1, idx[:, None]).squeeze(-1)

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

    def _feed(self, batch: Layout, ids: torch.Tensor, carry: torch.Tensor | None = None):
        """(logits [B, 1, V_head], predicted feature [B, 1, H]) of the last of ids [B, q]; the
        feature inputs are the target's (`carry` None, [B, q, F]) or the head's own previous
        prediction ([B, 1, H], no aux blocks)."""
        inputs = batch.inputs(self.role, ids.shape[1])
        if carry is None:
            carry = self.features.read(batch.seqs, inputs["position_ids"], self.model.dtype)
        out = self.model(input_ids=ids, features=carry, use_cache=True, logits_to_keep=1, **inputs)
        return out.logits, out.hidden_states


#: `LookupFirst` takes a row's lookup drafts when they continue a match of at least this many tokens.
MIN_MATCH = 2


class LookupFirst:
    """Prompt lookup first, a model proposer where lookup has no match of `min_match` tokens.
    The model's cache is rewound after each proposal (as the head's always is): rows that take the
    lookup's drafts leave no entries of the model's own drafts behind, and accepted tokens are fed
    to the model on the next step. Bins: the model's (0 .. model.bins - 1), then model.bins + the
    lookup's match length. The model is not called when every row takes the lookup's drafts. In a
    draft tree (`branches` > 1) a lookup row's leaves are the model's own drafts and next best, so
    the model's guess still counts where the lookup's breaks."""

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
        if bool(take.all()):
            return Proposal(found.drafts, found.num_proposed, found.signal + self.inner.bins, forwards=0)
        mine = torch.where(take[:, None], found.signal + self.inner.bins, 0)  # [B, k]

        def merged_stop(i: int, bins: torch.Tensor) -> bool:  # the policy sees each row's own source
            return stop(i, torch.where(take[:, None], mine[:, : i + 1], bins))

        drafted = self.inner.propose(batch, k, params, noise, None if stop is None else merged_stop)
        j = drafted.drafts.shape[1]
        counts = torch.where(take, found.num_proposed.clamp(max=j), j)
        drafts = torch.where(take[:, None], found.drafts[:, :j], drafted.drafts)
        signal = torch.where(take[:, None], mine[:, :j], drafted.signal)
        alternatives = drafted.alternatives
        if alternatives is not None:  # a lookup row's leaves: the model's own drafts, then its next best
            model = torch.cat([drafted.drafts[:, :, None], alternatives[:, :, :-1]], dim=2)
            alternatives = torch.where(take[:, None, None], model, alternatives)
        return Proposal(drafts, counts, signal, alternatives=alternatives)


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
