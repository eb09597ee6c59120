"""EXSPEC equals the reference exactly, returns results in input order, and its per-sequence
cache slices survive split-then-stack unchanged."""

from __future__ import annotations

import torch
from helpers import decode, random_prompts, reference_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder
from batchspec.cache import kv


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 40),
    batch=st.integers(1, 16),
    extra=st.integers(0, 16),
    k=st.integers(1, 8),
    max_new=st.integers(1, 40),
)
def test_exspec_equals_reference(tiny64, seed, n, batch, extra, k, max_new):
    prompts = random_prompts(seed, n, 1, 40)
    got = decode(tiny64, prompts, max_new, method="exspec", batch_size=batch, window_size=batch + extra, k=k)
    assert got == reference_tokens(tiny64, prompts, max_new)


@settings(max_examples=6)
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 5), min_group=st.integers(1, 5))
def test_exspec_invariants_and_partial_groups(tiny64, seed, batch, min_group):
    prompts = random_prompts(seed, 10, 1, 6)  # short prompts: many equal lengths, real groups
    got = decode(
        tiny64, prompts, 20, method="exspec", batch_size=batch, min_group=min_group, k=3, check_invariants=True
    )
    assert got == reference_tokens(tiny64, prompts, 20)


def test_results_come_back_in_input_order(tiny64):
    prompts = [random_prompts(30, 1, n, n)[0] for n in (50, 1, 30, 2, 10, 5)]
    dec = SpecDecoder(tiny64, method="exspec", batch_size=2, k=3)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=25))
    assert [o.index for o in outs] == list(range(6))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.token_ids for o in outs] == reference_tokens(tiny64, prompts, 25)
    stats = dec.stats.summary()  # fixed inputs, float64: the schedule is deterministic
    assert (stats["decode_steps"], stats["group_decisions"]) == (27, 3)
    assert stats["group_rate"] == 4 / 27


def test_group_rate_counts_unpadded_steps(tiny_same):
    """Equal prompts with every draft accepted stay equal in length: every step is a group."""
    prompt = random_prompts(31, 1, 8, 8)[0]
    dec = SpecDecoder(tiny_same, method="exspec", batch_size=4, k=3)
    dec.generate([prompt] * 4, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert dec.stats.summary()["group_rate"] == 1.0


def test_split_then_stack_is_identity(tiny64):
    config = tiny64.target.config
    torch.manual_seed(0)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    counts = [5, 2, 7]
    width = max(counts)
    seqs = [
        [(torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)) for _ in range(config.num_hidden_layers)]
        for n in counts
    ]
    cache = kv.stack(config, seqs, counts)
    assert kv.width(cache) == width
    back = kv.split(cache, [width - n for n in counts])
    for original, restored in zip(seqs, back):
        for (k0, v0), (k1, v1) in zip(original, restored):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    again = kv.stack(config, back, counts)
    for (k0, v0), (k1, v1) in zip(kv.tensors(cache), kv.tensors(again)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_row_that_holds_nothing_yet_stacks_as_padding(tiny64):
    """A row whose drafter was never fed (no entries, no layers) beside rows that hold entries: it
    contributes nothing (take 0), its columns are padding; it used to raise an IndexError."""
    config = tiny64.target.config
    torch.manual_seed(1)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    full = [(torch.randn(1, heads, 4, dim), torch.randn(1, heads, 4, dim)) for _ in range(config.num_hidden_layers)]
    cache = kv.stack(config, [full, [], full], [4, 0, 3])
    assert kv.width(cache) == 4
    for (k, v), (k0, v0) in zip(kv.tensors(cache), full):
        assert torch.equal(k[0:1, :, :4], k0) and torch.equal(v[2:3, :, 1:4], v0[:, :, :3])
        assert not k[1, :, :4].any() and not v[1, :, :4].any()
