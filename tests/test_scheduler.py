"""EXSPEC's scheduler, without models: simulated steps with random acceptance."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from batchspec.runners.scheduler import Scheduler


def simulate(prompt_lengths, batch, window, min_group, k, max_new, seed):
    """Drive the scheduler as exspec.run does; returns (decisions, per-sequence max wait)."""
    rng = random.Random(seed)
    sched = Scheduler(prompt_lengths, batch, window, min_group)
    lengths = dict(enumerate(prompt_lengths))
    generated = dict.fromkeys(lengths, 0)
    finished_order, decisions = [], []
    waits = dict.fromkeys(lengths, 0)
    last_seen: dict[int, int] = {}
    admitted: list[int] = []
    steps = 0
    while not sched.done():
        d = sched.next()
        admitted += [i for i in sched.window if i not in admitted]
        assert len(sched.window) <= window
        decisions.append(d)
        assert len(d.ids) == len(set(d.ids)) and 1 <= len(d.ids) <= batch, "a sequence is in a batch twice"
        assert all(i in sched.window for i in d.ids), "only sequences in the window run"
        if d.kind == "group":
            assert len({lengths[i] for i in d.ids}) == 1 and len(d.ids) >= min(min_group, batch)
        if d.kind != "prefill":
            for i in sched.window:
                if sched.window[i].prefilled:
                    waits[i] = max(waits[i], steps - last_seen.get(i, steps))
            for i in d.ids:
                last_seen[i] = steps
        done = set()
        for i in d.ids:
            grow = 1 if d.kind == "prefill" else rng.randint(1, k + 1)
            grow = min(grow, max_new - generated[i])
            lengths[i] += grow
            generated[i] += grow
            if generated[i] >= max_new or rng.random() < 0.02:
                done.add(i)
                finished_order.append(i)
        sched.ran(d.ids, lengths, done)
        steps += 1
        assert steps < 100_000, "scheduler does not terminate"
    assert admitted == list(range(len(prompt_lengths))), "admission is not in arrival order"
    return decisions, waits, finished_order


@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 16),
    extra=st.integers(0, 20),
    min_group=st.integers(1, 16),
    k=st.integers(1, 8),
    seed=st.integers(0, 10**6),
)
def test_scheduler_properties(n, batch, extra, min_group, k, seed):
    rng = random.Random(seed)
    prompt_lengths = [rng.choice([3, 5, 8, rng.randint(1, 60)]) for _ in range(n)]
    window = batch + extra
    decisions, waits, finished = simulate(prompt_lengths, batch, window, min_group, k, 30, seed)
    assert sorted(finished) == list(range(n)), "every admitted sequence finishes exactly once"
    sched = Scheduler(prompt_lengths, batch, window, min_group)
    assert max(waits.values()) <= sched.patience + 1, "a sequence waited past the fairness bound"
    prefilled = [i for d in decisions if d.kind == "prefill" for i in d.ids]
    assert sorted(prefilled) == list(range(n)), "every sequence is prefilled exactly once"


def test_admission_is_in_arrival_order():
    sched = Scheduler([5] * 10, batch_size=2, window=4, min_group=2)
    first = sched.next()
    assert first.kind == "prefill" and set(sched.window) == {0, 1, 2, 3} and first.ids == (0, 1)


def test_equal_prompt_lengths_prefill_together_without_padding():
    sched = Scheduler([7, 3, 7, 9, 7], batch_size=4, window=5, min_group=4)
    d = sched.next()
    assert d == type(d)("prefill", (0, 2, 4))


def test_largest_same_length_group_is_preferred():
    sched = Scheduler([4, 4, 6, 6, 6, 9], batch_size=3, window=6, min_group=3)
    while True:
        d = sched.next()
        if d.kind != "prefill":
            break
        sched.ran(d.ids, {i: sched.lengths[i] + 1 for i in d.ids}, set())
    assert d.kind == "group" and d.ids == (2, 3, 4)


def test_fallback_when_no_group_is_big_enough():
    sched = Scheduler([1, 2, 3, 4], batch_size=2, window=4, min_group=2)
    while True:
        d = sched.next()
        if d.kind != "prefill":
            break
        sched.ran(d.ids, {i: sched.lengths[i] + 1 for i in d.ids}, set())
    assert d.kind == "fallback" and len(d.ids) == 2
