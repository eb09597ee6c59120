"""Sampling through the whole engine: under a seed every method, batch size and k (fixed or
adaptive) gives exactly the tokens `reference` gives, and the joint distribution of the first two
tokens equals the target's (a bug in the noise's keying fails that test)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts
from test_acceptance import _chi2, chi2_critical

import batchspec.core.sampling
from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.core.sampling import probabilities


def _sample(pair, prompts, method, batch, seeds, params, k=3, proposer=None):
    per = [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds]
    dec = SpecDecoder(pair, method=method, batch_size=batch, k=k, proposer=proposer)
    return [o.token_ids for o in dec.generate(prompts, per)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, max_new_tokens=30),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=30),
    ],
)
def test_seeded_sampling_equals_reference_for_every_method_batch_and_k(tiny64, params):
    prompts = random_prompts(50, 9, 1, 40)
    seeds = [7] * 4 + [11, 12, 13, 14, 15]
    ref = _sample(tiny64, prompts, "reference", 1, seeds, params)
    for method in ("ar", "spec1", "eqspec", "exspec", "ragged"):
        for batch in (1, 4) if method != "spec1" else (1,):
            for k, proposer in ((3, "draft"), ("auto", "ngram")):  # test_speculation varies k per step
                got = _sample(tiny64, prompts, method, batch, seeds, params, k, proposer)
                assert got == ref, f"{method} at batch {batch}, k {k}, {proposer}"
    assert _sample(tiny64, prompts, "eqspec", 4, [99] * 9, params) != ref  # the seed matters


def _joint_frequencies(pair, prompt, params, trials, method="eqspec"):
    outs = _sample(pair, [prompt] * trials, method, trials, range(trials), params, k=2)
    vocab = pair.vocab_size
    freq = torch.zeros(vocab * vocab, dtype=torch.float64)
    for tokens in outs:
        freq[tokens[0] * vocab + tokens[1]] += 1
    return freq / trials


@torch.inference_mode()
def _exact_joint(pair, prompt, params):
    model = pair.target
    p1 = probabilities(model(input_ids=torch.tensor([prompt])).logits[0, -1], params).double()
    rows = [
        probabilities(model(input_ids=torch.tensor([prompt + [t]])).logits[0, -1], params).double()
        for t in range(pair.vocab_size)
    ]
    return (p1[:, None] * torch.stack(rows)).flatten()


@pytest.fixture(scope="module")
def small_vocab_pair():
    pair = tiny_pair(vocab_size=8, noise=0.5, dtype=torch.float64)  # a loose draft: many rejections
    pair.eos_ids = frozenset()
    return pair


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, max_new_tokens=2), SamplingParams(temperature=1.3, top_k=5, max_new_tokens=2)],
)
def test_first_two_tokens_follow_the_target(small_vocab_pair, params):
    prompt = [1, 5, 2, 6]
    trials = 6000
    exact = _exact_joint(small_vocab_pair, prompt, params)
    critical = chi2_critical(int((exact > 0).sum()) - 1)
    freq = _joint_frequencies(small_vocab_pair, prompt, params, trials)
    assert _chi2(freq, exact, trials) < critical
    assert 0.5 * (freq - exact).abs().sum() < 0.05


def test_noise_not_keyed_by_position_fails_the_joint_test(small_vocab_pair, monkeypatch):
    original = batchspec.core.sampling.gumbel
    monkeypatch.setattr(batchspec.core.sampling, "gumbel", lambda seed, position, vocab: original(seed, 0, vocab))
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    prompt, trials = [1, 5, 2, 6], 6000
    exact = _exact_joint(small_vocab_pair, prompt, params)
    freq = _joint_frequencies(small_vocab_pair, prompt, params, trials)
    assert _chi2(freq, exact, trials) > chi2_critical(int((exact > 0).sum()) - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_is_the_argmax_in_the_logits_own_dtype(dtype):
    """`sampling.greedy` finds the argmax in float32; the index is the one found in `dtype`, ties
    (frequent in bfloat16) resolved to the first as well."""
    from batchspec.core.sampling import greedy

    logits = (torch.randn(6, 3, 500, generator=torch.Generator().manual_seed(1)) * 4).round().to(dtype)
    assert int((logits == logits.max(dim=-1, keepdim=True).values).sum(-1).max()) > 1  # ties present
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy(logits, keepdim=True), logits.argmax(dim=-1, keepdim=True))
