"""Speculative sampling through the whole engine: seeded determinism across batch sizes and
methods, and the joint distribution of the first two tokens equals the target's."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts
from test_acceptance import _chi2, chi2_critical

import batchspec.acceptance
from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.sampling import probabilities


def _sample(pair, prompts, method, batch, seeds, params, k=3):
    per = [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds]
    outs = SpecDecoder(pair, method=method, batch_size=batch, k=k).generate(prompts, per)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, max_new_tokens=30),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=30),
    ],
)
def test_seed_gives_same_tokens_across_batch_sizes_and_methods(tiny64, params):
    prompts = random_prompts(50, 9, 1, 40)
    seeds = [7] * 4 + [11, 12, 13, 14, 15]
    base = _sample(tiny64, prompts, "spec1", 1, seeds, params)
    for method in ("spec1", "eqspec", "exspec", "ragged"):
        for batch in (1, 4, 8):
            assert _sample(tiny64, prompts, method, batch, seeds, params) == base, f"{method} at batch {batch}"
    assert _sample(tiny64, prompts, "eqspec", 4, [99] * 9, params) != base  # the seed matters


def test_ar_samples_exactly_like_reference(tiny64):
    prompts = random_prompts(51, 6, 1, 40)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=25)
    ref = _sample(tiny64, prompts, "reference", 1, range(6), params)
    assert _sample(tiny64, prompts, "ar", 4, range(6), params) == ref


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


def test_planted_wrong_rule_fails_the_joint_test(small_vocab_pair, monkeypatch):
    original = batchspec.acceptance.rejection_sample

    def wrong(drafts, draft_probs, target_probs, u_accept, u_final, limit=None):
        k = drafts.shape[1]
        p = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()
        keep = (u_accept < p).long().cumprod(-1).sum(-1)  # accept with probability target
        return original(drafts, draft_probs, target_probs, torch.zeros_like(u_accept), u_final, limit=keep)

    monkeypatch.setattr(batchspec.acceptance, "rejection_sample", wrong)
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    prompt, trials = [1, 5, 2, 6], 6000
    exact = _exact_joint(small_vocab_pair, prompt, params)
    freq = _joint_frequencies(small_vocab_pair, prompt, params, trials)
    assert _chi2(freq, exact, trials) > chi2_critical(int((exact > 0).sum()) - 1)
