"""The realignment-free ragged layout: exact equality with the reference, valid slots equal to a
fresh prefill after every step, continuous admission, and the KV budget."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from helpers import decode, random_prompts, reference_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import BatchspecError, SamplingParams, SpecDecoder


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 40),
    batch=st.integers(1, 16),
    k=st.integers(1, 8),
    max_new=st.integers(1, 48),
)
def test_ragged_equals_reference(tiny64, seed, n, batch, k, max_new):
    prompts = random_prompts(seed, n, 1, 64)
    random.Random(seed).shuffle(prompts)  # arrival order is arbitrary
    got = decode(tiny64, prompts, max_new, method="ragged", batch_size=batch, k=k)
    assert got == reference_tokens(tiny64, prompts, max_new)


@settings(max_examples=8)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 6), k=st.integers(1, 6))
def test_valid_slots_equal_a_fresh_prefill_after_every_step(tiny64, seed, batch, k):
    prompts = random_prompts(seed, 9, 1, 30)
    got = decode(tiny64, prompts, 24, method="ragged", batch_size=batch, k=k, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 24)


def test_ngram_proposer_without_a_draft_cache(tiny64):
    prompts = [[10, 11, 12, 13] * 5, [1, 2, 3, 1, 2], [7]]
    got = decode(tiny64, prompts, 30, method="ragged", batch_size=2, k=3, proposer="ngram", check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 30)


def test_decoding_never_realigns(tiny64, monkeypatch):
    """Rows keep their slots: no cache gather ever runs (the padded layouts' realignment), while
    rows of mixed lengths decode, finish and are replaced by newcomers."""

    def forbidden(*args, **kwargs):
        raise AssertionError("ragged must not realign a cache")

    monkeypatch.setattr("batchspec.cache.kv.gather", forbidden)
    prompts = random_prompts(60, 16, 1, 64)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # no row finishes at prefill
    dec = SpecDecoder(tiny64, method="ragged", batch_size=5, k=4)
    got = [o.token_ids for o in dec.generate(prompts, params)]
    ref = SpecDecoder(tiny64, method="reference").generate(prompts, params)
    assert got == [o.token_ids for o in ref]


def test_draft_slots_take_the_draft_dtype(tiny64):
    """A draft in another dtype than the target keeps its cache in its own dtype."""
    pair = replace(tiny64, draft=copy.deepcopy(tiny64.draft).to(torch.float32))
    prompts = random_prompts(62, 5, 3, 20)
    got = decode(pair, prompts, 20, method="ragged", batch_size=3, k=3, proposer="draft")
    assert got == reference_tokens(tiny64, prompts, 20)


def test_kv_budget_is_enforced_and_admission_waits_for_it(tiny64):
    prompts = random_prompts(61, 3, 10, 20)
    dec = SpecDecoder(tiny64, method="ragged", batch_size=2, k=4, kv_budget_tokens=30)
    with pytest.raises(BatchspecError, match=r"needs \d+ KV slots .* the KV budget is 30 tokens"):
        dec.generate(prompts, SamplingParams(max_new_tokens=32))
    # Each request needs up to 20 + 32 + 5 slots: a budget of 64 holds one at a time, so the
    # second row waits for the first to finish although a row is free.
    dec = SpecDecoder(tiny64, method="ragged", batch_size=2, k=4, kv_budget_tokens=64, check_invariants=True)
    out = dec.generate(prompts, SamplingParams(max_new_tokens=32))
    assert [o.token_ids for o in out] == reference_tokens(tiny64, prompts, 32)
    stats = dec.stats.summary()
    assert stats["kv_budget_tokens"] == 64 and stats["mean_batch_occupancy"] == 1.0


@settings(max_examples=12)
@given(seed=st.integers(0, 10**6), chunk=st.integers(1, 40), batch=st.integers(1, 4), k=st.integers(1, 5))
def test_chunked_prefill_at_every_boundary(tiny64, seed, chunk, batch, k):
    """Prompts arrive while rows decode and are prefilled `chunk` tokens per step: every chunk
    boundary position and every mix of whole and chunked prompts gives the reference's tokens."""
    prompts = random_prompts(seed, 7, 1, 90)
    got = decode(
        tiny64, prompts, 12, method="ragged", batch_size=batch, k=k, prefill_chunk=chunk, check_invariants=True
    )
    assert got == reference_tokens(tiny64, prompts, 12)


def test_mixed_lengths_up_to_two_thousand_tokens(tiny64):
    rng = random.Random(7)
    prompts = [random_prompts(70 + i, 1, n, n)[0] for i, n in enumerate([2000, 1, 3, 700, 17, 1500, 2, 64])]
    rng.shuffle(prompts)
    got = decode(tiny64, prompts, 10, method="ragged", batch_size=3, k=3, prefill_chunk=128, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 10)


def test_kv_slots_follow_the_tokens_held(tiny64):
    """Slots are allocated as rows fill, in size classes (256, 512, ... slots per row): a long row
    does not make every row as long, and moving rows between classes keeps every entry (exact
    equality, invariants on)."""
    short = random_prompts(80, 7, 5, 10)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    def peak(prompts):
        dec = SpecDecoder(tiny64, method="ragged", batch_size=8, k=2, check_invariants=True)
        outs = dec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [
            o.token_ids for o in SpecDecoder(tiny64, method="reference").generate(prompts, params)
        ]
        summary = dec.stats.summary()
        return summary["kv_peak_tokens"], summary["kv_peak_held_tokens"]

    # 7 rows of at most 10 + 8 + 3 slots: one slab of 256-slot rows, grown by half (1, 2, 3, 4, 6, 8 rows)
    allocated, held = peak(short)
    assert allocated == 8 * 256 and held <= 7 * 18
    # One 600-token row: its own row of 1,024 slots; the others keep theirs (was 8 x 640 = 5,120).
    allocated, held = peak(short + random_prompts(81, 1, 600, 600))
    assert allocated == 8 * 256 + 1024 and held >= 600
    # Rows that cross class boundaries while decoding (250 + 8 > 256, 505 + 8 > 512) move, once each:
    # at most 2 x 256 (before) + 3 x 512 (the 512 slab grown by half) + 1,024 at once.
    allocated, held = peak(random_prompts(82, 2, 250, 250) + random_prompts(83, 1, 505, 505))
    assert 2 * 512 + 1024 <= allocated <= 2 * 256 + 3 * 512 + 1024 and 1005 < held <= 1005 + 3 * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_slot_writes_copy_every_bit(dtype):
    """The slot cache's writes (16-bit floats through an int16 view): each row's new entries land
    at its slots with their exact bits (NaN, infinities, -0.0 included), the rest untouched, and
    the values equal a float scatter's."""
    from batchspec.cache.slots import write

    gen = torch.Generator().manual_seed(0)
    slab = torch.randn(3, 2, 16, 4, generator=gen).to(dtype)
    new = torch.randn(3, 2, 5, 4, generator=gen).to(dtype)
    new[0, 0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
    starts = [0, 7, 11]
    index = (torch.tensor(starts)[:, None] + torch.arange(5))[:, None, :, None].expand(-1, 2, -1, 4)
    expected = slab.clone()
    for b, s in enumerate(starts):
        expected[b, :, s : s + 5] = new[b]  # a plain copy: the same bytes
    scattered = slab.clone().scatter_(2, index, new)
    write(slab, index, new)
    assert torch.equal(slab.view(torch.uint8), expected.view(torch.uint8))
    assert torch.allclose(slab, scattered, rtol=0, atol=0, equal_nan=True)
