"""Logprobs: every emitted token's log-probability (and the top alternatives) is the target's own
at that position, the same as the one-sequence `reference` decoder's, whatever the method, batch
size, k, draft tree or sampling; rows that do not ask get none."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import random_prompts
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.core.errors import BatchspecError
from batchspec.core.logprobs import TokenLogprob, entries, log_distribution

# float64: a batched forward differs from the one-token reference by ~1e-15 in the logits.
TOLERANCE = 1e-9


def _outputs(pair, prompts, params, **config):
    return SpecDecoder(pair, **config).generate(prompts, params)


def _assert_same(ref, got, tolerance=TOLERANCE):
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert len(g.logprobs) == len(g.token_ids) == len(r.logprobs)
        for a, b, token in zip(r.logprobs, g.logprobs, g.token_ids):
            assert a.token == b.token == token
            assert abs(a.logprob - b.logprob) <= tolerance
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= tolerance for (_, x), (_, y) in zip(a.top, b.top))


def test_entries_are_log_softmax_after_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0], [0.5, 0.25, 3.0, -1.0]])
    got = entries(logits, [1, 2], [0.0, 0.5], [3, 0])
    expected = [torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1] / 0.5, -1)]
    assert got[0].token == 1 and math.isclose(got[0].logprob, float(expected[0][1]), rel_tol=1e-6)
    assert [t for t, _ in got[0].top] == [0, 1, 3]  # the tie (ids 1, 3) in id order
    assert got[1].top == () and math.isclose(got[1].logprob, float(expected[1][2]), rel_tol=1e-6)
    assert torch.allclose(log_distribution(logits, torch.tensor([0.0, 0.5])).exp().sum(-1), torch.ones(2))
    assert TokenLogprob(5, -0.5, ((5, -0.5),)).to_json() == {"token": 5, "logprob": -0.5, "top": [[5, -0.5]]}


@given(
    seed=st.integers(0, 10**6),
    batch_size=st.integers(1, 5),
    k=st.integers(1, 5),
    method=st.sampled_from(["ragged", "eqspec", "exspec", "ar"]),
    top=st.integers(0, 4),
)
def test_logprobs_equal_reference_across_methods(tiny64, seed, batch_size, k, method, top):
    prompts = random_prompts(seed, 4, 1, 40)
    params = SamplingParams(max_new_tokens=12, logprobs=top)
    ref = _outputs(tiny64, prompts, params, method="reference")
    config = {} if method == "ar" else {"k": k, "proposer": "draft"}
    _assert_same(ref, _outputs(tiny64, prompts, params, method=method, batch_size=batch_size, **config))


@pytest.fixture(scope="module")
def one_layer():
    """A 1-layer tiny pair whose head predicts well but not always: trees keep off-chain nodes."""
    return tiny_pair(layers=1, dtype=torch.float64)


@pytest.mark.parametrize("method", ["ragged", "eqspec"])
@pytest.mark.parametrize("branches", [3, (3, 2, 1)])
def test_logprobs_follow_a_draft_trees_accepted_path(one_layer, method, branches):
    prompts = random_prompts(7, 6, 2, 40)
    params = SamplingParams(max_new_tokens=24, logprobs=2)
    ref = _outputs(one_layer, prompts, params, method="reference")
    got = _outputs(one_layer, prompts, params, method=method, proposer="eagle", k=4, branches=branches, batch_size=3)
    _assert_same(ref, got)


def test_sampled_rows_get_the_logprobs_of_their_temperature(tiny64):
    prompts = random_prompts(9, 3, 3, 20)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=11, logprobs=1)
    ref = _outputs(tiny64, prompts, params, method="reference")
    _assert_same(ref, _outputs(tiny64, prompts, params, method="ragged", proposer="draft", k=3, batch_size=3))
    plain = _outputs(
        tiny64, prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, logprobs=1), method="reference"
    )
    assert ref[0].logprobs[0].logprob != plain[0].logprobs[0].logprob  # temperature 0.7 sharpens


def test_float32_logprobs_match_reference_closely(tiny32):
    prompts = random_prompts(3, 4, 2, 30)
    params = SamplingParams(max_new_tokens=10, logprobs=2)
    ref = _outputs(tiny32, prompts, params, method="reference")
    _assert_same(ref, _outputs(tiny32, prompts, params, method="ragged", k=4, batch_size=4), tolerance=1e-4)


def test_greedy_top_alternative_is_the_chosen_token(tiny64):
    out = _outputs(tiny64, random_prompts(5, 2, 4, 10), SamplingParams(max_new_tokens=8, logprobs=3), k=3)
    for o in out:
        assert all(e.top[0][0] == e.token and e.top[0][1] == e.logprob for e in o.logprobs)
        assert all(e.logprob <= 0 for e in o.logprobs)


def test_logprobs_are_cut_with_the_output_at_a_stop_string(tiny64):
    prompt = random_prompts(13, 1, 5, 5)[0]
    full = _outputs(tiny64, [prompt], SamplingParams(max_new_tokens=16, ignore_eos=True), method="reference")[0]
    middle = full.text[len(full.text) // 2 :]
    stop = next(c for c in middle if not c.isspace())  # a character the second half of the text shows
    out = _outputs(tiny64, [prompt], SamplingParams(max_new_tokens=16, ignore_eos=True, stop=(stop,), logprobs=0))[0]
    assert len(out.logprobs) == len(out.token_ids) < len(full.token_ids)
    assert "logprobs" in out.to_json() and len(out.to_json()["logprobs"]) == len(out.token_ids)


def test_rows_that_do_not_ask_get_none(tiny64):
    out = _outputs(tiny64, random_prompts(2, 2, 4, 10), SamplingParams(max_new_tokens=4), k=2)
    assert all(o.logprobs is None and "logprobs" not in o.to_json() for o in out)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_logprobs_value_is_refused(value):
    with pytest.raises(BatchspecError, match="logprobs"):
        SamplingParams(logprobs=value)
