"""Draft trees (`--branches C` or `C1xC2x..`): acceptance against a plain walk of the tree, the tree forward's
mask and positions, the drafters' beams against the same beam computed one path at a time, and
every method equal to `reference` with the head's and the draft's trees verified (greedy, any k
per step; seeded sampling: test_eagle.py), with the invariant checker on after every step."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_checked, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st
from test_speculation import RandomK

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.core.errors import BatchspecError
from batchspec.core.tree import Tree, accept, columns, depth_widths, restrict
from batchspec.engine.invariants import InvariantError
from batchspec.layouts.padded import PaddedBatch
from batchspec.layouts.ragged import RaggedBatch

METHODS = ("spec1", "eqspec", "exspec", "ragged")


@pytest.fixture(scope="module")
def one_layer():
    """A 1-layer tiny pair whose head predicts well but not always: chains break, leaves match."""
    return tiny_pair(layers=1, dtype=torch.float64)


def walk(tokens: list[int], parent: list[int], depth: list[int], choice: list[int], limit: int) -> list[int]:
    """The acceptance rule spelled out: a node is kept when it and every ancestor equal the target's
    pick at their parents (within the row's depth limit); take the deepest kept node (the first in
    node order on a tie); output its path's tokens and the target's pick at its end."""

    def path(n: int) -> list[int]:
        return [] if n < 0 else [*path(parent[n]), n]

    def matches(m: int) -> bool:
        return tokens[m] == choice[parent[m] + 1] and depth[m] <= limit

    kept = [n for n in range(len(tokens)) if all(matches(m) for m in path(n))]
    best = max(kept, key=lambda n: (depth[n], -n), default=-1)
    return [tokens[m] for m in path(best)] + [choice[best + 1]]


@given(
    widths=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    rows=st.integers(1, 4),
    seed=st.integers(0, 10**6),
    data=st.data(),
)
def test_accept_walks_the_tree(widths, rows, seed, data):
    """Any tree of C_d nodes at depth d, each row's parents its own (drawn at random one depth up)."""
    gen = torch.Generator().manual_seed(seed)
    k, starts = len(widths), [sum(widths[:d]) for d in range(len(widths))]
    parents = [torch.full((rows, widths[0]), -1)] + [
        starts[d - 1] + torch.randint(0, widths[d - 1], (rows, widths[d]), generator=gen) for d in range(1, k)
    ]
    tree = Tree(torch.cat(parents, dim=1), tuple(widths))
    tokens = torch.randint(0, 3, (rows, len(tree)), generator=gen)  # 3 ids: matches and ties are common
    choice = torch.randint(0, 3, (rows, len(tree) + 1), generator=gen)
    limit = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=rows, max_size=rows)))
    outcome, path = accept(tokens, tree, choice, limit)
    depth = tree.depth().tolist()
    for b in range(rows):
        parent = tree.parent[b].tolist()
        want = walk(tokens[b].tolist(), parent, depth, choice[b].tolist(), int(limit[b]))
        assert outcome.rows()[b] == want
        a = int(outcome.num_accepted[b])
        nodes = path[b, :a].tolist()
        assert [depth[n] for n in nodes] == list(range(1, a + 1))  # a path, one node per depth
        assert all(parent[n] == (nodes[i - 1] if i else -1) for i, n in enumerate(nodes))
        assert [int(tokens[b, n]) for n in nodes] == want[:-1]


def chain_with_alternatives(k: int, c: int) -> Tree:
    """At each depth a chain's node first (parent: the chain node one up), then c - 1 leaves
    beside it (same parent): the tree of a chain and its next-best tokens."""
    return Tree(torch.tensor([[(d - 1) * c if d else -1 for d in range(k) for _ in range(c)]]), (c,) * k)


def test_chain_with_alternatives_shape():
    tree = chain_with_alternatives(3, 3)
    assert tree.parent.tolist() == [[-1, -1, -1, 0, 0, 0, 3, 3, 3]]
    assert tree.depth().tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    anc = tree.ancestry()[0]
    assert anc[7].nonzero().flatten().tolist() == [0, 3, 7]  # a depth-3 leaf sees the chain above it and itself
    assert len(tree.cut(2)) == 6 and tree.cut(2).parent.tolist() == [[-1, -1, -1, 0, 0, 0]]


def test_widths_per_depth():
    assert depth_widths(3, 4) == (3, 3, 3, 3) and columns(3, 4) == 12
    assert depth_widths((4, 2, 1), 5) == (4, 2, 1, 1, 1) and columns((4, 2, 1), 2) == 6
    tree = Tree(torch.tensor([[-1, -1, -1, 0, 1, 3]]), (3, 2, 1))
    assert tree.depth().tolist() == [1, 1, 1, 2, 2, 3] and tree.starts() == [0, 3, 5]
    assert tree.ancestry()[0, 5].nonzero().flatten().tolist() == [0, 3, 5]
    assert tree.cut(2).widths == (3, 2) and len(tree.cut(2)) == 5


def test_restrict_padded_and_slot_masks():
    """The same tree, fed after one pending token, in a padded row (2-D mask, new columns last)
    and in a ragged row (4-D mask over slots): nodes see the prefix and their ancestors only."""
    tree = chain_with_alternatives(2, 2)  # nodes: d1, leaf@1, d2, leaf@2
    q = 1 + len(tree)
    padded = {"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]), "position_ids": torch.arange(2, 2 + q)[None]}
    out = restrict(padded, 1, tree)
    assert out["position_ids"].tolist() == [[2, 3, 3, 4, 4]]
    mask = out["attention_mask"][0, 0].int().tolist()
    assert mask == [
        [0, 1, 1, 1, 0, 0, 0, 0],  # the pending token: causal
        [0, 1, 1, 1, 1, 0, 0, 0],  # d1
        [0, 1, 1, 1, 0, 1, 0, 0],  # leaf beside d1
        [0, 1, 1, 1, 1, 0, 1, 0],  # d2: d1 and itself
        [0, 1, 1, 1, 1, 0, 0, 1],  # leaf beside d2: d1 and itself
    ]
    start = 5  # a ragged row writing its 5 new entries at slots 5..9 of a span of 12
    slots = torch.arange(start, start + q)[None]
    slot_mask = (torch.arange(12)[None, None, :] <= slots[:, :, None])[:, None]
    out = restrict({"attention_mask": slot_mask, "position_ids": slots}, 1, tree)
    assert out["position_ids"].tolist() == [[5, 6, 6, 7, 7]]
    got = out["attention_mask"][0, 0].int()
    assert got[:, :5].all() and not got[:, 10:].any()
    assert got[:, 5:10].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]


BRANCHES = st.one_of(st.integers(2, 4), st.lists(st.integers(1, 4), min_size=2, max_size=4).map(tuple))


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    batch=st.integers(1, 4),
    k=st.integers(1, 5),
    branches=BRANCHES,
    method=st.sampled_from(METHODS),
)
def test_head_tree_equals_reference(one_layer, seed, n, batch, k, branches, method):
    """C nodes per depth, or C_d at depth d (narrowing, widening, chains between)."""
    prompts = random_prompts(seed, n, 1, 48)
    got, _ = decode_checked(
        one_layer, prompts, SamplingParams(max_new_tokens=24), method=method, batch_size=batch, k=k, branches=branches
    )
    assert got == reference_tokens(one_layer, prompts, 24)


@given(
    seed=st.integers(0, 10**6),
    method=st.sampled_from(METHODS),
    proposer=st.sampled_from(["draft", "ngram+eagle"]),
    branches=st.sampled_from([3, (1, 3), (3, 1)]),  # (1, 3): the lookup's chain alone at depth 1
)
def test_draft_and_lookup_first_trees_equal_reference(tiny64, seed, method, proposer, branches):
    prompts = random_prompts(seed, 5, 1, 40)
    options = {"method": method, "batch_size": 3, "k": 3, "branches": branches}
    got, _ = decode_checked(tiny64, prompts, SamplingParams(max_new_tokens=20), proposer, **options)
    assert got == reference_tokens(tiny64, prompts, 20)


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS))
def test_any_choice_of_k_per_step_with_a_tree(one_layer, seed, method):
    """Plain steps, early stops and per-row limits cut the tree at each row's depth: still exact."""
    prompts = random_prompts(seed, 5, 1, 40)
    params = SamplingParams(max_new_tokens=24)
    policy = RandomK(seed)
    got, _ = decode_checked(one_layer, prompts, params, policy=policy, method=method, batch_size=3, k=5, branches=2)
    assert got == reference_tokens(one_layer, prompts, 24)


def test_trees_add_tokens(one_layer):
    """A step yields more with a tree than with the chain (so the tests above keep off-chain nodes)."""
    prompts = random_prompts(3, 6, 1, 40)
    params = SamplingParams(max_new_tokens=32)
    _, chain = decode_checked(one_layer, prompts, params, method="ragged", batch_size=3, k=4)
    _, tree = decode_checked(one_layer, prompts, params, method="ragged", batch_size=3, k=4, branches=3)
    assert tree.summary()["mean_tokens_per_step"] > chain.summary()["mean_tokens_per_step"]


@pytest.mark.parametrize("method, layout", [("eqspec", PaddedBatch), ("ragged", RaggedBatch)])
def test_checker_sees_a_leaf_left_in_place(one_layer, monkeypatch, method, layout):
    """Without moving a kept leaf's cache entry to the chain's slot, the target's cache holds the
    chain's rejected draft there: the invariant checker must say so."""
    monkeypatch.setattr(layout, "keep_path", lambda self, role, nodes, index: None)
    with pytest.raises(InvariantError, match="target row"):
        decode_checked(
            one_layer,
            random_prompts(0, 5, 1, 48),
            SamplingParams(max_new_tokens=24),
            method=method,
            batch_size=3,
            k=4,
            branches=3,
        )


def test_bad_branches_are_refused(tiny64):
    for bad in (0, -1, 1.5, (), (2, 0), (2, 1.5)):
        with pytest.raises(BatchspecError, match="branches"):
            SpecDecoder(tiny64, proposer="eagle", branches=bad)
    with pytest.raises(BatchspecError, match="model proposer"):
        SpecDecoder(tiny64, proposer="ngram", branches=2)
    with pytest.raises(BatchspecError, match="model proposer"):
        SpecDecoder(tiny64, proposer="ngram", branches=[1, 2])  # a list is widths per depth too
    with pytest.raises(BatchspecError, match="chains only"):
        SpecDecoder(tiny64, proposer="draft", method="bsp", branches=2)


def one_path_at_a_time(proposer, batch):
    """children(path [B, d]) -> the drafter's log-probs [B, V_head] of the token after the path,
    computed without a tree forward: the path fed as a plain chain after the committed tokens
    (then rewound)."""
    mark = batch.mark(proposer.role)
    last = torch.tensor([[s.token_ids[-1]] for s in batch.seqs])

    def children(path: torch.Tensor) -> torch.Tensor:
        batch.rewind(proposer.role, mark - 1)  # re-feed the last committed token: the root's logits
        logits, carry = proposer._feed(batch, last)
        for i in range(path.shape[1]):
            logits, carry = proposer._feed(batch, path[:, i : i + 1], carry)
        batch.rewind(proposer.role, mark)
        return torch.log_softmax(logits[:, -1].double(), dim=-1)

    return children


def beam(children, b: int, widths: tuple[int, ...], to_full, forced=None) -> list[list[torch.Tensor]]:
    """The beam spelled out: per depth d, the c = widths[d] paths [B, d] (best first) with the best
    cumulative log-probability among the c best children of each path one depth up. forced (tokens
    [B, k], counts [B]): row r's first counts[r] depths put the path of those tokens first (score
    0), then the c - 1 best others."""
    paths, cums, out = [torch.zeros(b, 0, dtype=torch.long)], torch.zeros(b, 1, dtype=torch.float64), []
    for d, c in enumerate(widths):
        scores = torch.stack([children(p) for p in paths], dim=1) + cums[:, :, None]  # [B, m, V_head]
        top, idx = scores.topk(c, dim=-1)
        cand = [
            [(float(top[r, m, i]), m, int(to_full(idx[r, m, i : i + 1]))) for m in range(len(paths)) for i in range(c)]
            for r in range(b)
        ]
        rows = []
        for r in range(b):
            if forced is not None and int(forced[1][r]) > d:
                token = int(forced[0][r, d])
                others = [x for x in cand[r] if not (x[1] == 0 and x[2] == token)]
                rows.append([(0.0, 0, token)] + sorted(others, key=lambda x: -x[0])[: c - 1])
            else:
                rows.append(sorted(cand[r], key=lambda x: -x[0])[:c])
        cums = torch.tensor([[x[0] for x in row] for row in rows], dtype=torch.float64)
        paths = [
            torch.stack([torch.cat([paths[rows[r][j][1]][r], torch.tensor([rows[r][j][2]])]) for r in range(b)])
            for j in range(c)
        ]
        out.append(paths)
    return out


def node_path(tree: Tree, nodes: torch.Tensor, node: int) -> torch.Tensor:
    """[B, depth]: each row's tokens from the root's child down to `node`."""
    cols, at = [], torch.full((nodes.shape[0],), node)
    while int(at[0]) >= 0:
        cols.insert(0, nodes.gather(1, at[:, None]))
        at = tree.parent.gather(1, at[:, None])[:, 0]
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("proposer, branches", [("eagle", 3), ("draft", 3), ("ngram+eagle", 3), ("eagle", (3, 2, 1))])
@pytest.mark.parametrize("method", ["spec1", "eqspec", "ragged"])
def test_tree_drafting_equals_one_path_at_a_time(tiny64, monkeypatch, proposer, branches, method):
    """Every tree the head or the draft builds (C = 3 or 3x2x1, k = 4; with lookup first, around
    the lookup chain) is the beam recomputed by feeding each node's path as a plain chain, and every tree
    forward's logits are those of each node's own chain: its masks and positions are right in
    every layout."""
    from batchspec.proposers.draft import DraftProposer

    original, checked = DraftProposer._propose_tree, []

    def checked_tree(self, batch, k, params, noise, stop, forced=None):
        fed, feed = [], self._feed

        def recording(batch_, ids, carry=None, view=None):
            out = feed(batch_, ids, carry, view)
            if view is not None:
                fed.append(torch.log_softmax(out[0].double(), dim=-1))
            return out

        self._feed = recording
        got = original(self, batch, k, params, noise, stop, forced)
        del self._feed
        widths, starts, children = got.tree.widths, got.tree.starts(), one_path_at_a_time(self, batch)
        for d, logp in enumerate(fed):  # the forward of depth d + 1's nodes
            for j in range(widths[d]):
                want = children(node_path(got.tree, got.nodes, starts[d] + j))
                torch.testing.assert_close(logp[:, j], want, rtol=0, atol=1e-9)
        for d, paths in enumerate(beam(children, len(batch.seqs), widths, self._to_full, forced)):
            for j, path in enumerate(paths):
                got_path = node_path(got.tree, got.nodes, starts[d] + j)
                assert got_path.tolist() == path.tolist(), f"depth {d + 1}, node {j}"
        checked.append((len(fed), 0 if forced is None else int((forced[1] > 0).sum())))
        return got

    monkeypatch.setattr(DraftProposer, "_propose_tree", checked_tree)
    prompts = random_prompts(5, 4, 1, 40, vocab=12 if "ngram" in proposer else 256)  # few ids: lookup matches
    options = {"method": method, "batch_size": 3, "k": 4, "branches": branches}
    got, _ = decode_checked(tiny64, prompts, SamplingParams(max_new_tokens=12), proposer, **options)
    assert got == reference_tokens(tiny64, prompts, 12)
    assert sum(f for f, _ in checked) > 10
    assert ("ngram" in proposer) == (sum(n for _, n in checked) > 0)  # rows with a lookup chain were checked
