"""`--proposer ngram+eagle` / `ngram+draft` (proposer.LookupFirst): per row, prompt lookup where it
matches, the model elsewhere. Exact in every method (greedy with fixed, random and adaptive k,
seeded sampling), the model's cache rewound after each proposal (checked after every step), both
sources used, refused where it cannot run."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import reference_tokens
from hypothesis import given
from hypothesis import strategies as st
from test_speculation import RandomK

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.core.errors import BatchspecError
from batchspec.proposers.lookup_first import LookupFirst

METHODS = ("spec1", "eqspec", "exspec", "ragged")
PROPOSERS = ("ngram+eagle", "ngram+draft")


@pytest.fixture(scope="module")
def one_layer():
    """A 1-layer tiny pair whose head and draft both accept some drafts (see test_eagle.py)."""
    return tiny_pair(layers=1, dtype=torch.float64)


def echo_prompts(seed: int, n: int, vocab: int = 256, echo: float = 0.6) -> list[list[int]]:
    """Random prompts, a share `echo` of which end by repeating a stretch of 2+ of their tokens
    (lookup matches there)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if len(head) >= 3 and rng.random() < echo:
            start = rng.randrange(len(head) - 2)
            head = head + head[start : start + rng.randint(2, 12)]
        out.append(head)
    return out


def _decode(pair, prompts, params, proposer, policy=None, min_match=1, **config):
    """Decode with lookup taking matches of `min_match`+ tokens (1 here: the tiny models' text
    rarely repeats two tokens, and both sources must be exercised)."""
    dec = SpecDecoder(pair, proposer=proposer, check_invariants=True, **config)
    dec.proposer.min_match = min_match
    if policy is not None:
        dec.speculation = policy
    return [o.token_ids for o in dec.generate(prompts, params)], dec


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    batch=st.integers(1, 5),
    k=st.sampled_from([1, 2, 4, 6, "auto"]),
    method=st.sampled_from(METHODS),
    proposer=st.sampled_from(PROPOSERS),
    min_match=st.integers(1, 3),
)
def test_equals_reference(one_layer, seed, n, batch, k, method, proposer, min_match):
    prompts = echo_prompts(seed, n)
    params = SamplingParams(max_new_tokens=24)
    got, _ = _decode(one_layer, prompts, params, proposer, min_match=min_match, method=method, batch_size=batch, k=k)
    assert got == reference_tokens(one_layer, prompts, 24)


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS), proposer=st.sampled_from(PROPOSERS))
def test_any_choice_of_k_per_step_equals_reference(one_layer, seed, method, proposer):
    """Plain steps (the model lags and catches up), early stops, verify widths: all exact."""
    prompts = echo_prompts(seed, 5)
    got, _ = _decode(
        one_layer, prompts, SamplingParams(max_new_tokens=24), proposer, RandomK(seed), method=method, batch_size=3, k=5
    )
    assert got == reference_tokens(one_layer, prompts, 24)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_seeded_sampling_equals_reference(one_layer, proposer):
    prompts = echo_prompts(8, 5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_new_tokens=20) for s in range(5)]
    ref = [o.token_ids for o in SpecDecoder(one_layer, method="reference").generate(prompts, params)]
    for method in METHODS:
        got, _ = _decode(one_layer, prompts, params, proposer, method=method, batch_size=3, k=3)
        assert got == ref, method


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_both_sources_propose_and_get_accepted(one_layer, proposer, monkeypatch):
    """Rows take the lookup's drafts where it matches (bins >= model.bins) and the model's
    elsewhere, in the same steps and in steps of lookup alone (the model not called)."""
    seen = {"lookup": 0, "model": 0, "lookup_only_steps": 0}
    propose = LookupFirst.propose

    def counting(self, batch, k, params, noise, stop=None):
        calls = {"n": 0}
        inner = self.inner.propose

        def inner_counted(*a, **kw):
            calls["n"] += 1
            return inner(*a, **kw)

        self.inner.propose = inner_counted  # this instance only, for this call
        try:
            out = propose(self, batch, k, params, noise, stop)
        finally:
            del self.inner.propose
        lookup_rows = out.signal[:, 0] >= self.inner.bins
        seen["lookup"] += int(lookup_rows.sum())
        seen["model"] += int((~lookup_rows).sum())
        seen["lookup_only_steps"] += calls["n"] == 0
        assert calls["n"] == (0 if bool(lookup_rows.all()) else 1)
        assert out.forwards == (0 if calls["n"] == 0 else None)  # what auto charges the model for
        return out

    monkeypatch.setattr(LookupFirst, "propose", counting)
    prompts = echo_prompts(11, 8, echo=1.0)
    params = SamplingParams(max_new_tokens=40)
    got, dec = _decode(one_layer, prompts, params, proposer, method="ragged", batch_size=2, k=4)
    assert got == reference_tokens(one_layer, prompts, 40)
    assert seen["lookup"] > 0 and seen["model"] > 0 and seen["lookup_only_steps"] > 0, seen
    assert sum(int(n) for a, n in dec.stats.summary()["accepted_histogram"].items() if int(a) > 0) > 0


def test_refused_by_the_broken_baselines(one_layer):
    with pytest.raises(BatchspecError, match="rewind"):
        SpecDecoder(one_layer, method="bsp", proposer="ngram+draft")
