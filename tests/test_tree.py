"""Draft trees (`--branches C`): acceptance against a plain walk of the tree, the tree forward's
mask and positions, and every method equal to `reference` with the head's and the draft's
alternatives verified as leaves (greedy, any k per step; seeded sampling: test_eagle.py), with the invariant
checker on after every step."""

from __future__ import annotations

import pytest
import torch
from helpers import decode_checked, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st
from test_speculation import RandomK

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.batch import PaddedBatch
from batchspec.errors import BatchspecError
from batchspec.invariants import InvariantError
from batchspec.ragged import RaggedBatch
from batchspec.tree import Tree, accept, restrict

METHODS = ("spec1", "eqspec", "exspec", "ragged")


@pytest.fixture(scope="module")
def one_layer():
    """A 1-layer tiny pair whose head predicts well but not always: chains break, leaves match."""
    return tiny_pair(layers=1, dtype=torch.float64)


def walk(tokens: list[int], tree: Tree, choice: list[int], limit: int) -> list[int]:
    """The acceptance rule spelled out: from the root, follow the first child (in node order)
    equal to the target's pick at the current node; output the path and the pick at its end."""
    out, node = [], -1
    depth = tree.depth()
    while True:
        pick = choice[node + 1]
        child = next(
            (n for n, p in enumerate(tree.parent) if p == node and tokens[n] == pick and depth[n] <= limit), None
        )
        out.append(pick)
        if child is None:
            return out
        node = child


@given(
    k=st.integers(1, 5),
    c=st.integers(1, 4),
    rows=st.integers(1, 4),
    seed=st.integers(0, 10**6),
    data=st.data(),
)
def test_accept_walks_the_tree(k, c, rows, seed, data):
    tree = Tree.chain_with_alternatives(k, c)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (rows, len(tree)), generator=gen)  # 3 ids: matches and ties are common
    choice = torch.randint(0, 3, (rows, len(tree) + 1), generator=gen)
    limit = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=rows, max_size=rows)))
    outcome, path = accept(tokens, tree, choice, limit)
    depth = tree.depth()
    for b in range(rows):
        want = walk(tokens[b].tolist(), tree, choice[b].tolist(), int(limit[b]))
        assert outcome.rows()[b] == want
        a = int(outcome.num_accepted[b])
        nodes = path[b, :a].tolist()
        assert [depth[n] for n in nodes] == list(range(1, a + 1))  # a path, one node per depth
        assert all(tree.parent[n] == (nodes[i - 1] if i else -1) for i, n in enumerate(nodes))
        assert [int(tokens[b, n]) for n in nodes] == want[:-1]


def test_chain_with_alternatives_shape():
    tree = Tree.chain_with_alternatives(3, 3)
    assert tree.parent == (-1, 0, 1, -1, -1, 0, 0, 1, 1)
    assert tree.depth() == [1, 2, 3, 1, 1, 2, 2, 3, 3]
    anc = tree.ancestry()
    assert anc[7].nonzero().flatten().tolist() == [0, 1, 7]  # a depth-3 leaf sees d1, d2 and itself


def test_restrict_padded_and_slot_masks():
    """The same tree, fed after one pending token, in a padded row (2-D mask, new columns last)
    and in a ragged row (4-D mask over slots): nodes see the prefix and their ancestors only."""
    tree = Tree.chain_with_alternatives(2, 2)  # nodes: d1, d2, leaf@1, leaf@2
    q = 1 + len(tree)
    padded = {"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]), "position_ids": torch.arange(2, 2 + q)[None]}
    out = restrict(padded, 1, tree)
    assert out["position_ids"].tolist() == [[2, 3, 4, 3, 4]]
    mask = out["attention_mask"][0, 0].int().tolist()
    assert mask == [
        [0, 1, 1, 1, 0, 0, 0, 0],  # the pending token: causal
        [0, 1, 1, 1, 1, 0, 0, 0],  # d1
        [0, 1, 1, 1, 1, 1, 0, 0],  # d2
        [0, 1, 1, 1, 0, 0, 1, 0],  # leaf beside d1
        [0, 1, 1, 1, 1, 0, 0, 1],  # leaf beside d2: d1 and itself
    ]
    start = 5  # a ragged row writing its 5 new entries at slots 5..9 of a span of 12
    slots = torch.arange(start, start + q)[None]
    slot_mask = (torch.arange(12)[None, None, :] <= slots[:, :, None])[:, None]
    out = restrict({"attention_mask": slot_mask, "position_ids": slots}, 1, tree)
    assert out["position_ids"].tolist() == [[5, 6, 7, 6, 7]]
    got = out["attention_mask"][0, 0].int()
    assert got[:, :5].all() and not got[:, 10:].any()
    assert got[:, 5:10].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    batch=st.integers(1, 4),
    k=st.integers(1, 5),
    c=st.integers(2, 4),
    method=st.sampled_from(METHODS),
)
def test_head_tree_equals_reference(one_layer, seed, n, batch, k, c, method):
    prompts = random_prompts(seed, n, 1, 48)
    got, _ = decode_checked(
        one_layer, prompts, SamplingParams(max_new_tokens=24), method=method, batch_size=batch, k=k, branches=c
    )
    assert got == reference_tokens(one_layer, prompts, 24)


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS), proposer=st.sampled_from(["draft", "ngram+eagle"]))
def test_draft_and_lookup_first_trees_equal_reference(tiny64, seed, method, proposer):
    prompts = random_prompts(seed, 5, 1, 40)
    got, _ = decode_checked(
        tiny64, prompts, SamplingParams(max_new_tokens=20), proposer, method=method, batch_size=3, k=3, branches=3
    )
    assert got == reference_tokens(tiny64, prompts, 20)


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS))
def test_any_choice_of_k_per_step_with_a_tree(one_layer, seed, method):
    """Plain steps, early stops and per-row limits cut the tree at each row's depth: still exact."""
    prompts = random_prompts(seed, 5, 1, 40)
    params = SamplingParams(max_new_tokens=24)
    policy = RandomK(seed)
    got, _ = decode_checked(one_layer, prompts, params, policy=policy, method=method, batch_size=3, k=5, branches=2)
    assert got == reference_tokens(one_layer, prompts, 24)


def test_leaves_add_tokens(one_layer):
    """Leaves are kept (the tests above exercise them) and a step yields more with them."""
    prompts = random_prompts(3, 6, 1, 40)
    params = SamplingParams(max_new_tokens=32)
    _, chain = decode_checked(one_layer, prompts, params, method="ragged", batch_size=3, k=4)
    _, tree = decode_checked(one_layer, prompts, params, method="ragged", batch_size=3, k=4, branches=3)
    assert tree.extra["leaf_tokens"] > 0
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
    for bad in (0, -1, 1.5):
        with pytest.raises(BatchspecError, match="branches"):
            SpecDecoder(tiny64, proposer="eagle", branches=bad)
    with pytest.raises(BatchspecError, match="model proposer"):
        SpecDecoder(tiny64, proposer="ngram", branches=2)
    with pytest.raises(BatchspecError, match="chains only"):
        SpecDecoder(tiny64, proposer="draft", method="bsp", branches=2)
