"""The n-gram (prompt lookup) proposer: unit cases, and exact equality with the reference for
every method that takes a proposer."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers import decode, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder
from batchspec.proposers.ngram import NgramIndex, lookup, lookup_match


def test_match_found_takes_the_longest_suffix_first():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3]
    assert lookup(tokens, 3, max_n=3) == [9, 9, 2]  # "1 2 3" last seen at 0, followed by 9 9 2
    assert lookup([7, 2, 3, 8, 5, 3], 2, max_n=3) == [8, 5]  # only "3" matches (n = 1)


def test_most_recent_occurrence_wins():
    assert lookup([5, 1, 5, 2, 5], 1, max_n=1) == [2]


def test_no_match():
    assert lookup([1, 2, 3, 4], 4) == []
    assert lookup([1], 4) == []


def test_match_at_the_very_end_and_k_beyond_the_continuation():
    assert lookup([4, 4, 4], 5, max_n=1) == [4]  # most recent earlier "4" is followed by the last token
    assert lookup([1, 2, 1, 2], 5, max_n=2) == [1, 2]  # continuation shorter than k


def _repetitive_prompts():
    base = [10, 11, 12, 13, 14, 15, 16, 17]
    return [base * 3, base[:5] * 4 + [99], [1, 2, 3, 1, 2, 3, 1], [200], base[::-1] * 2]


@pytest.mark.parametrize("method, batch", [("spec1", 1), ("eqspec", 3), ("exspec", 2), ("bsp", 1)])
def test_ngram_methods_match_reference(tiny64, method, batch):
    prompts = _repetitive_prompts()
    got = decode(tiny64, prompts, 30, method=method, batch_size=batch, k=4, proposer="ngram")
    ref = reference_tokens(tiny64, prompts, 30)
    if method == "bsp":
        assert got != ref  # the broken baseline stays broken with any proposer
    else:
        assert got == ref


def test_ngram_acceptance_is_what_lookup_predicts(tiny64):
    """Each step of a row accepts exactly the common prefix of `lookup`'s proposal and the
    reference's continuation; the engine's histogram must equal that, counted independently."""
    prompts, k, max_new = _repetitive_prompts(), 4, 30
    dec = SpecDecoder(tiny64, method="eqspec", k=k, batch_size=5, proposer="ngram", check_invariants=True)
    dec.generate(prompts, SamplingParams(max_new_tokens=max_new))
    expected = Counter()
    for prompt, ref in zip(prompts, reference_tokens(tiny64, prompts, max_new)):
        done = 1  # the first token comes from prefill
        while done < len(ref):
            proposal = lookup(prompt + ref[:done], k)
            accepted = next((i for i, (a, b) in enumerate(zip(proposal, ref[done:])) if a != b), len(proposal))
            kept = min(accepted + 1, len(ref) - done)  # the row stops at max_new_tokens or EOS
            expected[min(accepted, kept)] += 1
            done += kept
    assert dec.stats.summary()["accepted_histogram"] == {str(n): c for n, c in sorted(expected.items())}
    assert expected[0] < sum(expected.values())  # the prompts are built so that lookups hit


@given(
    seed=st.integers(0, 10**6),
    vocab=st.sampled_from([2, 3, 5, 40]),
    max_n=st.integers(1, 4),
    steps=st.integers(1, 12),
)
def test_incremental_index_equals_lookup(seed, vocab, max_n, steps):
    """The proposer's per-sequence index gives `lookup`'s answer as the token list grows."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
    index = NgramIndex(max_n, 1)
    for _ in range(steps):
        k = rng.randint(1, 6)
        assert index.lookup(tokens, k) == lookup_match(tokens, k, max_n, 1)
        tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
