"""Prefix caching: prompts that begin with a finished row's tokens start from its KV entries and
get exactly the tokens (and logprobs) they get without the cache, with every proposer and under
any k; the store finds the longest whole-block prefix, never the whole prompt, and stays bounded."""

from __future__ import annotations

import random

import torch
from helpers import reference_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder
from batchspec.cache.prefixes import BLOCK, PrefixCache, would_reuse
from batchspec.core.sequence import Sequence


def _entries(n: int, value: float = 1.0):
    return {"target": [(torch.full((1, 2, n, 4), value), torch.full((1, 2, n, 4), -value))]}


def _row(tokens: list[int]) -> Sequence:
    return Sequence(index=0, prompt_ids=tokens, max_len=len(tokens) + 8, eos_ids=frozenset())


def test_match_is_the_longest_whole_block_prefix_short_of_the_prompt():
    store = PrefixCache(max_tokens=1000)
    tokens = list(range(3 * BLOCK + 5))
    store.put(_row(tokens), _entries(len(tokens)), {"target": len(tokens)})
    assert store.match(tokens[: 2 * BLOCK]).length == BLOCK  # the last token is always fed
    assert store.match(tokens[: 2 * BLOCK + 1]).length == 2 * BLOCK
    assert store.match(tokens + [7, 8]).length == 3 * BLOCK
    assert store.match([99] + tokens[1:]) is None
    assert store.match(tokens[:BLOCK]) is None
    assert store.match(tokens[:BLOCK] + [5] * BLOCK + [1]).length == BLOCK


def test_a_hash_collision_is_a_miss(monkeypatch):
    store = PrefixCache(max_tokens=1000)
    tokens = list(range(2 * BLOCK))
    store.put(_row(tokens), _entries(len(tokens)), {"target": len(tokens)})
    monkeypatch.setattr(store, "_hashes", lambda toks, limit: [h for h in store.index][: max(0, limit // BLOCK)])
    assert store.match([5] * (2 * BLOCK + 1)) is None


def test_lru_bound_and_extended_entries_are_dropped():
    store = PrefixCache(max_tokens=4 * BLOCK)
    first = list(range(2 * BLOCK))
    store.put(_row(first), _entries(len(first)), {"target": len(first)})
    longer = first + list(range(100, 100 + BLOCK))  # a chat's next turn: extends the first entry
    store.put(_row(longer), _entries(len(longer)), {"target": len(longer)})
    assert len(store.entries) == 1 and store.held == 3 * BLOCK
    other = list(range(500, 500 + 2 * BLOCK))
    store.put(_row(other), _entries(len(other)), {"target": len(other)})
    assert store.held <= 4 * BLOCK and store.match(other + [1]) is not None
    assert store.match(longer + [1]) is None  # the least recently used went
    assert all(key in store.entries for key in store.index.values())
    assert store.held_bytes == 2 * 2 * 4 * 4 * store.held  # K and V of [1, 2, n, 4] float32 per entry
    store.put(_row(list(range(5 * BLOCK))), _entries(5 * BLOCK), {"target": 5 * BLOCK})  # larger than the bound
    assert store.held <= 4 * BLOCK and store.held_bytes == 64 * store.held


def test_taken_entries_are_copies():
    store = PrefixCache(max_tokens=1000)
    tokens = list(range(2 * BLOCK))
    store.put(_row(tokens), _entries(len(tokens), 2.0), {"target": len(tokens)})

    class Config:
        num_hidden_layers = 1

    seq = _row(tokens + [1])
    caches = store.take(seq, store.match(seq.token_ids), {"target": type("M", (), {"config": Config})()})
    caches["target"].layers[0].keys.zero_()
    stored = next(iter(store.entries.values())).kv["target"][0][0]
    assert bool((stored == 2.0).all())
    assert store.summary()["hits"] == 1 and store.summary()["reused_tokens"] == 2 * BLOCK


def test_only_prompts_that_would_reuse_half_are_held_out_of_a_group():
    """A chat template's shared opening (24 tokens of 40: one block, under half) keeps prompts in
    one prefill group; the same prompt again, or a long shared system prompt, waits for the entries."""
    template = list(range(24))
    a, b = _row(template + [100] * 16), _row(template + [200] * 16)
    assert not would_reuse(b, [a])
    assert would_reuse(_row(a.prompt_ids), [a])
    system = list(range(3 * BLOCK))
    assert would_reuse(_row(system + [7] * 10), [_row(system + [9] * 30)])
    assert not would_reuse(_row(list(range(BLOCK))), [_row(list(range(BLOCK)))])  # nothing to reuse: 1 block, all fed


def _turns(seed: int, pair, turns: int, max_new: int) -> list[list[int]]:
    """A chat's prompts: each the previous prompt, the target's answer to it, and new tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(40, 60))]
    out = []
    for _ in range(turns):
        out.append(prompt)
        answer = reference_tokens(pair, [prompt], max_new)[0]
        prompt = prompt + answer + [rng.randrange(256) for _ in range(rng.randint(1, 12))]
    return out


@settings(max_examples=10)
@given(
    seed=st.integers(0, 10**6),
    batch_size=st.integers(1, 3),
    k=st.one_of(st.integers(1, 4), st.just("auto")),
    proposer=st.sampled_from(["draft", "eagle", "ngram+eagle"]),
)
def test_prompts_from_cached_prefixes_equal_reference(tiny64, seed, batch_size, k, proposer):
    """Two chats of three turns and prompts sharing a system prompt, more than the rows: later
    prompts are admitted after earlier ones left, from their entries."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(rng.randint(BLOCK, 3 * BLOCK))]
    shared = [system + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    prompts = _turns(seed, tiny64, 3, 10) + _turns(seed + 1, tiny64, 3, 10) + shared
    params = SamplingParams(max_new_tokens=10)
    dec = SpecDecoder(
        tiny64,
        method="ragged",
        batch_size=batch_size,
        k=k,
        proposer=proposer,
        prefix_cache_tokens=10_000,
        check_invariants=True,
    )
    got = [o.token_ids for o in dec.generate(prompts, params)]
    assert got == reference_tokens(tiny64, prompts, 10)
    assert dec.stats.extra["prefix_cache"]["hits"] >= 1


def test_sampled_rows_and_logprobs_are_the_same_with_the_cache(tiny64):
    prompts = _turns(5, tiny64, 4, 8)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, logprobs=2)
    plain = SpecDecoder(tiny64, method="ragged", batch_size=1, k=3, proposer="draft").generate(prompts, params)
    dec = SpecDecoder(tiny64, method="ragged", batch_size=1, k=3, proposer="draft", prefix_cache_tokens=10_000)
    cached = dec.generate(prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    for a, b in zip(plain, cached):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-9 and [t for t, _ in x.top] == [t for t, _ in y.top]
    assert dec.stats.extra["prefix_cache"]["hits"] == 3


@given(seed=st.integers(0, 10**6), proposer=st.sampled_from(["draft", "eagle"]), k=st.sampled_from([2, "auto"]))
def test_prompts_admitted_together_share_one_prefill(tiny64, seed, proposer, k):
    """The same prompt three times and prompts sharing a system prompt, all admitted at once: the
    first of each is prefilled whole, the others start from its stored entries."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(BLOCK + 1, 60))]
    system = [rng.randrange(256) for _ in range(2 * BLOCK)]
    shared = [system + [rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    prompts = [prompt] * 3 + shared
    params = SamplingParams(max_new_tokens=8)
    dec = SpecDecoder(
        tiny64, method="ragged", batch_size=5, k=k, proposer=proposer, prefix_cache_tokens=10_000, check_invariants=True
    )
    got = [o.token_ids for o in dec.generate(prompts, params)]
    assert got == reference_tokens(tiny64, prompts, 8)
    summary = dec.stats.extra["prefix_cache"]
    assert summary["hits"] == 3 and summary["reused_tokens"] >= 2 * ((len(prompt) - 1) // BLOCK) * BLOCK + 2 * BLOCK
