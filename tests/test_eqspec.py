"""EQSPEC: a synchronous padded batch realigned after every step equals the reference exactly,
keeps every synchronization invariant, and the tests see the bug class the paper describes."""

from __future__ import annotations

import pytest
import torch
from helpers import decode, random_prompts, reference_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

import batchspec.layouts.padded
from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.engine.invariants import InvariantError


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 16),
    batch=st.integers(1, 16),
    k=st.integers(1, 8),
    max_new=st.integers(1, 64),
)
def test_eqspec_equals_reference(tiny64, seed, n, batch, k, max_new):
    prompts = random_prompts(seed, n, 1, 64)
    got = decode(tiny64, prompts, max_new, method="eqspec", batch_size=batch, k=k)
    assert got == reference_tokens(tiny64, prompts, max_new)


@settings(max_examples=8)
@given(seed=st.integers(0, 10**6), batch=st.integers(2, 6), k=st.integers(1, 6))
def test_invariants_hold_after_every_step(tiny64, seed, batch, k):
    prompts = random_prompts(seed, batch, 1, 40)
    got = decode(tiny64, prompts, 24, method="eqspec", batch_size=batch, k=k, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 24)


def test_every_draft_accepted(tiny_same):
    prompts = random_prompts(20, 6, 1, 50)
    dec = SpecDecoder(tiny_same, method="eqspec", k=4, batch_size=6, check_invariants=True)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=41, ignore_eos=True))
    assert set(dec.stats.accepted_hist) == {4, 0} or set(dec.stats.accepted_hist) == {4}  # last step may clip
    ref = SpecDecoder(tiny_same, method="reference").generate(
        prompts, SamplingParams(max_new_tokens=41, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_no_draft_accepted():
    pair = tiny_pair(dtype=torch.float64)
    pair.draft = tiny_pair(dtype=torch.float64, seed=99).target  # an unrelated model: acceptance ~ chance
    prompts = random_prompts(21, 6, 1, 50)
    dec = SpecDecoder(pair, method="eqspec", k=3, batch_size=6, check_invariants=True)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=30))
    hist = dec.stats.accepted_hist
    assert hist[0] / sum(hist.values()) > 0.9
    assert [o.token_ids for o in outs] == reference_tokens(pair, prompts, 30)


def test_one_row_stops_mid_chunk_while_others_continue(tiny_same):
    prompts = random_prompts(22, 4, 5, 30)
    ref = reference_tokens(tiny_same, prompts, 30)
    eos = ref[0][9]  # row 0 emits this mid-run; with all drafts accepted it lands inside a chunk
    saved, tiny_same.eos_ids = tiny_same.eos_ids, frozenset([eos])
    try:
        dec = SpecDecoder(tiny_same, method="eqspec", k=5, batch_size=4, check_invariants=True)
        outs = dec.generate(prompts, SamplingParams(max_new_tokens=30))
        expected = reference_tokens(tiny_same, prompts, 30)
    finally:
        tiny_same.eos_ids = saved
    assert [o.token_ids for o in outs] == expected
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == eos
    assert "length" in {o.finish_reason for o in outs[1:]}


def test_very_different_prompt_lengths(tiny64):
    prompts = [random_prompts(23, 1, 1, 1)[0], random_prompts(24, 1, 300, 300)[0], random_prompts(25, 1, 17, 17)[0]]
    got = decode(tiny64, prompts, 40, method="eqspec", batch_size=3, k=4, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 40)


def test_batch_larger_than_prompt_count(tiny64):
    prompts = random_prompts(26, 3, 1, 30)
    assert decode(tiny64, prompts, 30, method="eqspec", batch_size=16, k=3) == reference_tokens(tiny64, prompts, 30)


def test_float32_fixed_cases(tiny32):
    prompts = random_prompts(27, 12, 1, 64)
    assert decode(tiny32, prompts, 48, method="eqspec", batch_size=8, k=5) == reference_tokens(tiny32, prompts, 48)


def _padded_column_positions(pad_left, start, q):
    """The bug: positions from the padded column, ignoring each row's padding."""
    cols = torch.arange(start, start + q, device=pad_left.device)
    return cols[None, :].expand(pad_left.shape[0], q)


def test_broken_positions_are_caught(tiny64, monkeypatch):
    prompts = random_prompts(28, 8, 1, 64)
    expected = reference_tokens(tiny64, prompts, 40)
    monkeypatch.setattr(batchspec.layouts.padded, "column_positions", _padded_column_positions)
    got = decode(tiny64, prompts, 40, method="eqspec", batch_size=8, k=4)
    assert got != expected, "the equivalence test must fail on positions taken from the padded column"
    with pytest.raises(InvariantError, match="positions skip or repeat|differ from a fresh prefill"):
        decode(tiny64, prompts, 40, method="eqspec", batch_size=8, k=4, check_invariants=True)


def test_skipped_kv_shift_is_caught(tiny64, monkeypatch):
    """Cropping the caches instead of shifting each row's entries leaves rows misaligned."""
    prompts = random_prompts(29, 8, 1, 64)
    expected = reference_tokens(tiny64, prompts, 40)
    gather = batchspec.layouts.padded.kv.gather

    def crop_only(cache, rows, index, full_batch):  # the bug: keep the first columns, shift nothing
        gather(cache, rows, torch.arange(index.shape[1]).expand_as(index), full_batch)

    monkeypatch.setattr(batchspec.layouts.padded.kv, "gather", crop_only)
    assert decode(tiny64, prompts, 40, method="eqspec", batch_size=8, k=4) != expected
    with pytest.raises(InvariantError):
        decode(tiny64, prompts, 40, method="eqspec", batch_size=8, k=4, check_invariants=True)


def test_length_buckets_bound_padding():
    from batchspec.layouts.buckets import length_buckets

    assert length_buckets([]) == []
    assert length_buckets([7]) == [1]
    assert length_buckets([10, 10, 11, 12]) == [4]
    assert length_buckets([1, 17, 300]) == [1, 1, 1]
    lengths = sorted(len(p) for p in random_prompts(31, 40, 1, 200))
    sizes = length_buckets(lengths, slack=1.25)
    assert sum(sizes) == len(lengths)
    first = 0
    for n in sizes:
        bucket = lengths[first : first + n]
        assert n == 1 or n * bucket[-1] <= 1.25 * sum(bucket)
        first += n


@pytest.mark.parametrize("method", ["ar", "eqspec"])
def test_bucketed_prefill_equals_reference(tiny64, method):
    from batchspec.layouts.buckets import length_buckets

    prompts = random_prompts(32, 7, 2, 12) + random_prompts(33, 2, 150, 200)  # two long prompts pad the rest
    assert len(length_buckets(sorted(map(len, prompts)))) > 1
    got = decode(tiny64, prompts, 30, method=method, batch_size=9, k=4, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 30)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_realign_plan_truncates_exactly_when_the_gather_keeps_columns(data):
    """A role whose plan is a truncation (no index) would get, from the general gather, its first
    `width` columns unchanged; the plan truncates exactly when every row grew by the same amount."""
    from batchspec.layouts import realign

    b = data.draw(st.integers(1, 4))
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, 12), min_size=b, max_size=b)))
    grow = torch.tensor(data.draw(st.lists(st.integers(1, 5), min_size=b, max_size=b)))
    old_width = int(lengths.max())
    pad_left = old_width - lengths
    cache_width = old_width - 1 + data.draw(st.integers(0, 4))  # target lag 1 plus fed drafts
    p = realign.plan(pad_left, {"target": cache_width}, lengths + grow, torch.ones(b, dtype=torch.bool))
    rp = p.roles["target"]
    cached = (cache_width - pad_left).clamp(min=0)
    lag = max(1, int((lengths + grow - cached).max()))
    general = realign.shift_index(pad_left, (lengths + grow - lag).clamp(min=0), cache_width)
    assert (rp.index is None) == (bool((grow == grow[0]).all()) and rp.width <= cache_width)
    assert rp.width == general.shape[1]
    if rp.index is None:
        assert general.tolist() == torch.arange(rp.width).expand(b, -1).tolist()
    else:
        assert rp.index.tolist() == general.tolist()
