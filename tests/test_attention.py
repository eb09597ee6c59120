"""attention.py: packed grouped-query attention and per-row spans compute transformers' SDPA
attention; the ragged layout cut into runs stays equal to the reference; the oracle never uses it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import decode, random_prompts, reference_tokens, run_script
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchspec import SamplingParams, SpecDecoder, attention


class Heads(torch.nn.Module):
    """What the attention functions read of a module: its grouping and causality."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@settings(max_examples=60, deadline=None)
@given(ends=st.lists(st.integers(1, 3000), min_size=1, max_size=24), call=st.integers(0, 5000))
def test_segments_cover_every_row_in_order_at_no_more_than_one_run(ends, call):
    runs = attention.segments(ends, call)
    assert runs[0][0] == 0 and runs[-1][1] == len(ends)
    assert all(a < z for a, z, _ in runs) and all(z == a2 for (_, z, _), (a2, _, _) in zip(runs, runs[1:]))
    assert all(span == max(ends[a:z]) for a, z, span in runs)
    cost = sum(call + (z - a) * span for a, z, span in runs)
    assert cost <= call + len(ends) * max(ends)


def test_segments_cut_only_when_it_saves_a_call():
    assert attention.segments([100] * 16, 1024) == [(0, 16, 100)]
    assert attention.segments([1500, 1500, 200, 200], 1024) == [(0, 2, 1500), (2, 4, 200)]
    assert attention.segments([1500, 200, 1500, 200], 10_000) == [(0, 4, 1500)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 6),
    q=st.integers(1, 6),
    groups=st.sampled_from([1, 2, 3]),
    split=st.booleans(),
)
def test_attention_equals_transformers_sdpa(seed, batch, q, groups, split):
    """Each row sees slots up to its own end (a ragged mask); cut into runs or not, the output is
    transformers' SDPA attention's over the whole span."""
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
    runs = attention.segments(ends.tolist(), 0 if split else None)
    got, _ = attention.attention(module, query, key, value, mask, scaling=0.3, row_spans=runs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_reference_decoder_runs_transformers_attention_alone(tiny64, monkeypatch):
    """The oracle's forwards carry no mask, so they never reach batchspec's attention code."""
    calls = []
    monkeypatch.setattr(attention, "_one", lambda *a: calls.append(a) or pytest.fail("batchspec attention"))
    SpecDecoder(tiny64, method="reference").generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=4))
    assert calls == []


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), batch=st.integers(2, 8), k=st.integers(1, 6))
def test_ragged_cut_into_runs_equals_reference(tiny64, seed, batch, k):
    """With a call costing one entry, rows of mixed lengths attend in many runs; tokens and cache
    invariants are the reference's."""
    rng = random.Random(seed)
    prompts = [random_prompts(seed + i, 1, n, n)[0] for i, n in enumerate(rng.choices([1, 3, 40, 300], k=9))]
    runs_seen = []
    segments = attention.segments
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "CALL_ENTRIES", 1)
        mp.setattr(attention, "segments", lambda ends: runs_seen.append(len(segments(ends))) or segments(ends))
        got = decode(tiny64, prompts, 16, method="ragged", batch_size=batch, k=k, check_invariants=True)
    assert got == reference_tokens(tiny64, prompts, 16)
    assert max(runs_seen) > 1  # the forwards were cut


def test_attention_cost_script_tiny(tmp_path):
    """scripts/attention_cost.py runs on the tiny pair and times both attentions at every shape."""
    out = tmp_path / "times.json"
    run_script("attention_cost.py", "--pair", "tiny", "--widths", "1,3", "--repeats", "1", "--json", str(out))
    times = json.loads(out.read_text())
    assert len(times) == 6 and all(set(t) == {"sdpa", "batchspec"} for t in times.values())
    assert all(set(ms) == {"1", "3"} and min(ms.values()) > 0 for t in times.values() for ms in t.values())
