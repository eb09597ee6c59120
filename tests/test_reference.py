"""The oracle and the plain baselines: `reference` equals transformers' own greedy `generate`;
`ar` (batched) and `spec1` equal `reference` token for token."""

from __future__ import annotations

import torch
from helpers import decode, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder


def test_reference_equals_transformers_generate(tiny32):
    pair = tiny32
    for prompt in random_prompts(0, 6, 1, 50):
        ours = SpecDecoder(pair, method="reference").generate([prompt], SamplingParams(max_new_tokens=40))[0]
        ids = torch.tensor([prompt])
        hf = pair.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=40,
            eos_token_id=sorted(pair.eos_ids),
            pad_token_id=pair.pad_id,
        )[0, len(prompt) :].tolist()
        if ours.finish_reason == "stop":  # HF pads after EOS
            hf = hf[: len(ours.token_ids)]
        assert ours.token_ids == hf


def test_reference_stops_at_eos_and_length(tiny64):
    prompts = random_prompts(1, 40, 1, 30)
    outs = SpecDecoder(tiny64, method="reference").generate(prompts, SamplingParams(max_new_tokens=30))
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}, "the tiny pair should hit EOS on some of 40 prompts"
    for o in outs:
        eos_positions = [i for i, t in enumerate(o.token_ids) if t in tiny64.eos_ids]
        if o.finish_reason == "stop":
            assert eos_positions == [len(o.token_ids) - 1]
        else:
            assert eos_positions == [] and len(o.token_ids) == 30


@given(seed=st.integers(0, 10**6), n=st.integers(1, 12), batch=st.integers(1, 16), max_new=st.integers(1, 40))
def test_ar_equals_reference(tiny64, seed, n, batch, max_new):
    prompts = random_prompts(seed, n, 1, 64)
    assert decode(tiny64, prompts, max_new, method="ar", batch_size=batch) == reference_tokens(tiny64, prompts, max_new)


@given(seed=st.integers(0, 10**6), k=st.integers(1, 8), max_new=st.integers(1, 40))
def test_spec1_equals_reference(tiny64, seed, k, max_new):
    prompts = random_prompts(seed, 3, 1, 64)
    got = decode(tiny64, prompts, max_new, method="spec1", k=k, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, max_new)


def test_spec1_k_beyond_remaining_budget(tiny64):
    prompts = random_prompts(2, 4, 5, 20)
    for max_new in (1, 2, 3):
        assert decode(tiny64, prompts, max_new, method="spec1", k=8) == reference_tokens(tiny64, prompts, max_new)


def test_spec1_all_accepted_when_draft_is_target(tiny_same):
    prompts = random_prompts(3, 4, 3, 30)
    dec = SpecDecoder(tiny_same, method="spec1", k=5, check_invariants=True)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=37, ignore_eos=True))
    for o in outs:
        assert o.accepted_per_step[:-1] == [5] * (len(o.accepted_per_step) - 1)  # k+1 tokens per step
        assert len(o.token_ids) == 37
    ref = SpecDecoder(tiny_same, method="reference").generate(
        prompts, SamplingParams(max_new_tokens=37, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_eos_inside_an_accepted_run_stops_there(tiny_same):
    """With every draft accepted, an EOS in the middle of a k+1 chunk must end the row there."""
    prompt = random_prompts(4, 1, 10, 10)[0]
    plain = SpecDecoder(tiny_same, method="reference").generate(
        [prompt], SamplingParams(max_new_tokens=30, ignore_eos=True)
    )[0]
    eos = plain.token_ids[7]  # a token the target emits mid-run
    first = plain.token_ids.index(eos)
    tiny_same.eos_ids, saved = frozenset([eos]), tiny_same.eos_ids
    try:
        for method in ("spec1", "eqspec"):
            out = SpecDecoder(tiny_same, method=method, k=6).generate([prompt], SamplingParams(max_new_tokens=30))[0]
            assert out.token_ids == plain.token_ids[: first + 1]
            assert out.finish_reason == "stop"
    finally:
        tiny_same.eos_ids = saved
