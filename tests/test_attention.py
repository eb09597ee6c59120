"""attention.py: packed grouped-query attention and per-class spans compute transformers' SDPA
attention; the ragged layout in size classes stays equal to the reference; the oracle never uses it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import decode, random_prompts, reference_tokens, run_script
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchspec import SamplingParams, SpecDecoder
from batchspec.cache import slots
from batchspec.models import attention


class Heads(torch.nn.Module):
    """What the attention functions read of a module: its grouping and causality."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _as_parts(key, value, ends, parts: int, gen) -> tuple[slots.RowParts, slots.RowParts]:
    """key/value [B, H_kv, span, D] as `slots.RowParts`: the rows in a random order, in up to
    `parts` groups, each over its own longest row's span (ends [B])."""
    batch = key.shape[0]
    order = torch.randperm(batch, generator=gen)
    groups = [g for g in order.tensor_split(min(parts, batch)) if len(g)]
    spans = [int(ends[g].max()) for g in groups]
    return tuple(slots.RowParts([(g, t[g][:, :, :s]) for g, s in zip(groups, spans)]) for t in (key, value))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 6),
    q=st.integers(1, 6),
    groups=st.sampled_from([1, 2, 3]),
    parts=st.integers(1, 4),
)
def test_attention_equals_transformers_sdpa(seed, batch, q, groups, parts):
    """Each row sees slots up to its own end (a ragged mask); whole or as `slots.RowParts` (rows in
    any order, each part over its own longest row's span), the output is transformers' SDPA
    attention's over the whole span."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim = 2, 8
    ends = torch.randint(q, 40, (batch,), generator=gen)
    span = int(ends.max())
    query = torch.randn(batch, kv_heads * groups, q, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, span, dim, generator=gen) for _ in range(2))
    positions = ends[:, None] - q + torch.arange(q)[None, :]  # [B, q]
    mask = (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, q, span]
    module = Heads(groups)
    want = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)[0]
    got, _ = attention.attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    keys, values = _as_parts(key, value, ends, parts, gen)
    got, _ = attention.attention(module, query, keys, values, mask, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got, _ = attention.attention(module, query, keys, values, mask, scaling=0.3, output_attentions=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # transformers' function on the parts made dense


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 5),
    q=st.integers(1, 5),
    window=st.integers(1, 12),
    parts=st.integers(1, 3),
)
def test_a_sliding_layer_reads_its_windows_span_and_attends_as_over_the_whole(seed, batch, q, window, parts):
    """A layer with a window reads its keys from the first one a query sees (`seen_span`), whole or
    as `slots.RowParts`: the output is transformers' SDPA attention's over the whole span with the
    mask cut to the window."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim, groups = 2, 8, 2
    ends = torch.randint(q, 60, (batch,), generator=gen)
    span = int(ends.max())
    query = torch.randn(batch, kv_heads * groups, q, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, span, dim, generator=gen) for _ in range(2))
    positions = ends[:, None] - q + torch.arange(q)[None, :]
    mask = (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]
    module = Heads(groups)
    want = sdpa_attention_forward(module, query, key, value, attention.windowed(mask, window), scaling=0.3)[0]
    cut = attention.seen_span(attention.windowed(mask, window), key, value)
    assert cut[1].shape[2] == cut[0].shape[-1] == span - attention.first_seen(attention.windowed(mask, window))
    got, _ = attention.attention(module, query, key, value, mask, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    keys, values = _as_parts(key, value, ends, parts, gen)
    got, _ = attention.attention(module, query, keys, values, mask, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # read from the earliest query's window start: the shortest row's first query, `window` keys back
    assert attention.first_seen(attention.windowed(mask, window)) == max(0, int(ends.min()) - q - window + 1)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 5),
    q=st.integers(1, 4),
    groups=st.sampled_from([1, 2, 3]),
    long=st.booleans(),
)
def test_planned_attention_is_the_caches_update_then_attention(seed, batch, q, groups, long):
    """`Planned` (one forward's attention planned once for its layers) writes the same slab entries
    and returns the same bits as the cache's `update` followed by `attention` (its bool mask made
    additive once, as SDPA makes it on every call), layer by layer: one size class in order or
    several (rows long enough for the 512-slot class), one row's one query (the unmasked kernel),
    grouped heads or not."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim, layers = 2, 8, 2
    config = LlamaConfig(
        hidden_size=kv_heads * groups * dim,
        num_attention_heads=kv_heads * groups,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
    )
    config._attn_implementation = attention.NAME
    ends = torch.randint(q, 600 if long else 200, (batch,), generator=gen)
    positions = ends[:, None] - q + torch.arange(q)[None, :]  # [B, q]
    caches = [slots.SlotCache(config, torch.float32, "cpu", batch) for _ in range(2)]
    for cache in caches:
        cache.prepare(batch, positions)
    for layer_a, layer_b in zip(*(c.layers for c in caches)):
        for slabs_a, slabs_b in ((layer_a.keys, layer_b.keys), (layer_a.values, layer_b.values)):
            for c, slab in slabs_a.items():
                slab.copy_(torch.randn(slab.shape, generator=gen))
                slabs_b[c].copy_(slab)
    span = int(ends.max())
    mask = (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, q, span]
    planned = attention.plan(caches[0], mask, config)
    assert planned is not None
    module = Heads(groups)
    for layer in range(layers):
        query = torch.randn(batch, kv_heads * groups, q, dim, generator=gen)
        key, value = (torch.randn(batch, kv_heads, q, dim, generator=gen) for _ in range(2))
        got = planned(query, key, value, layer, 0.3)
        keys, values = caches[1].update(key, value, layer)
        want, _ = attention.attention(module, query, keys, values, mask, scaling=0.3)
        assert torch.equal(got, want)
    for layer_a, layer_b in zip(*(c.layers for c in caches)):
        for slabs_a, slabs_b in ((layer_a.keys, layer_b.keys), (layer_a.values, layer_b.values)):
            assert all(torch.equal(slab, slabs_b[c]) for c, slab in slabs_a.items())


def test_no_plan_where_attention_is_not_batchspecs(tiny64):
    """A cache other than the ragged slots, a per-head mask or another attention function: the
    layers call the attention function as before."""
    config = tiny64.target.config
    cache = slots.SlotCache(config, torch.float32, "cpu", 1)
    cache.prepare(1, torch.tensor([[4]]))
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    assert attention.plan(cache, mask, config) is not None
    assert attention.plan(None, mask, config) is None
    assert attention.plan(cache, mask.expand(1, 4, 1, 5), config) is None
    assert attention.plan(cache, None, config) is None
    other = type(config)(**config.to_dict())
    other._attn_implementation = "sdpa"
    assert attention.plan(cache, mask, other) is None


def test_the_reference_decoder_runs_transformers_attention_alone(tiny64, monkeypatch):
    """The oracle's forwards carry no mask, so they never reach batchspec's attention code."""
    calls = []
    monkeypatch.setattr(attention, "_one", lambda *a: calls.append(a) or pytest.fail("batchspec attention"))
    SpecDecoder(tiny64, method="reference").generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=4))
    assert calls == []


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(2, 8), k=st.integers(1, 6))
def test_ragged_in_size_classes_equals_reference(tiny64, seed, batch, k):
    """Rows of mixed lengths (size classes of 256, 512 and 1,024 slots) attend class by class;
    tokens and cache invariants are the reference's."""
    rng = random.Random(seed)
    lengths = rng.choices([1, 3, 40, 300], k=7) + [300, 600]
    rng.shuffle(lengths)
    prompts = [random_prompts(seed + i, 1, n, n)[0] for i, n in enumerate(lengths)]
    got = decode(tiny64, prompts, 16, method="ragged", batch_size=batch, k=k, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 16)


def test_rows_of_several_classes_attend_in_one_call_per_class(tiny64, monkeypatch):
    """A 600-token row beside short ones: forwards plan one part per class in use, and the tokens
    are the reference's."""
    plans = []
    prepare = slots.SlotCache.prepare

    def spy(self, rows, positions):
        prepare(self, rows, positions)
        plans.append(sorted(c for c, *_ in self.plan))

    monkeypatch.setattr(slots.SlotCache, "prepare", spy)
    prompts = [random_prompts(90 + i, 1, n, n)[0] for i, n in enumerate([3, 40, 300, 600])]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    dec = SpecDecoder(tiny64, method="ragged", batch_size=4, k=3, check_invariants=True)
    got = [o.token_ids for o in dec.generate(prompts, params)]
    want = [o.token_ids for o in SpecDecoder(tiny64, method="reference").generate(prompts, params)]
    assert got == want
    assert [0, 1, 2] in plans  # 256-, 512- and 1,024-slot classes in one forward


@pytest.mark.scripts
def test_attention_cost_script_tiny(tmp_path):
    """experiments/attention_cost.py runs on the tiny pair and times both attentions at every shape."""
    out = tmp_path / "times.json"
    run_script("attention_cost.py", "--pair", "tiny", "--widths", "1,3", "--repeats", "1", "--json", str(out))
    times = json.loads(out.read_text())
    assert len(times) == 6 and all(set(t) == {"sdpa", "batchspec"} for t in times.values())
    assert all(set(ms) == {"1", "3"} and min(ms.values()) > 0 for t in times.values() for ms in t.values())
