"""Admission's chunk (admission.py): the prefill cost fit recovers a + b n, the chunk is the prefill
that costs `share` decode steps (never below the size where the fixed part dominates), and it
grows with the rows left idle for want of admission; a wave of prompts gets its first tokens
forward by forward; with a longest gap set, a burst of long prompts never holds a running row
longer than the gap allows."""

from __future__ import annotations

from helpers import random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder
from batchspec.engine import admission
from batchspec.engine.admission import MIN_CHUNK, Admission, PrefillCost
from batchspec.engine.loop import Loop
from batchspec.engine.step import Context
from batchspec.layouts.ragged import RaggedBatch


@given(
    a=st.floats(0.0, 0.2),
    b=st.floats(1e-5, 1e-2),
    sizes=st.lists(st.integers(1, 2048), min_size=3, max_size=40).filter(lambda xs: min(xs) * 2 < max(xs)),
)
def test_the_fit_recovers_an_affine_cost(a, b, sizes):
    cost = PrefillCost()
    for n in [*sizes, 1, 2048]:  # the latest, weightiest sizes spread: a and b are separable
        cost.observe(n, a + b * n)
    assert abs(cost.b - b) <= 1e-6 * b + 1e-9
    assert abs(cost.a - a) <= 1e-5


def test_sizes_too_alike_do_not_make_the_chunk_explode():
    """Noisy timings of near-equal sizes fit a tiny b and a / b in the tens of thousands: the fit
    waits for sizes that spread before it separates a from b."""
    cost = PrefillCost()
    for n, t in ((100, 0.15), (110, 0.1501), (100, 0.1499), (110, 0.1502)):
        cost.observe(n, t)
    assert cost.a == 0.0 and cost.tokens_for(0.6) < 500


def test_one_size_seen_is_all_per_token():
    cost = PrefillCost()
    for _ in range(5):
        cost.observe(100, 0.5)
    assert cost.a == 0.0 and abs(cost.b - 0.005) < 1e-12


def test_the_chunk_costs_share_steps_and_never_less_than_the_fixed_part_pays_for():
    adm = Admission(ctx=None, share=1.0)
    for n in (16, 64, 256, 1024):
        adm.cost.observe(n, 0.05 + 0.001 * n)  # a = 50 ms, b = 1 ms per token
    adm.observe_step(0.2)
    assert adm.chunk(running=8, idle=0) == 150  # (0.2 - 0.05) / 0.001
    assert adm.chunk(running=8, idle=7) == 325  # share x 15 / 8: (0.375 - 0.05) / 0.001
    adm.step_s = 0.06  # a fast step: the chunk where the fixed part is half the forward
    assert adm.chunk(running=8, idle=0) == 50
    assert adm.chunk(running=8, idle=7) >= adm.chunk(running=8, idle=0)


@given(running=st.integers(1, 16), idle=st.integers(0, 16))
def test_idle_rows_as_many_as_running_ones_are_all_admitted(running, idle):
    adm = Admission(ctx=None)
    adm.cost.observe(100, 0.1)
    adm.observe_step(0.05)
    assert (adm.chunk(running, idle) is None) == (idle >= running)


@given(steps=st.lists(st.floats(1e-3, 1.0), min_size=1, max_size=5), running=st.integers(1, 16))
def test_the_chunk_is_at_least_min_chunk(steps, running):
    adm = Admission(ctx=None)
    adm.cost.observe(10, 5.0)  # absurdly slow prefill
    for s in steps:
        adm.observe_step(s)
    assert adm.chunk(running, 0) >= MIN_CHUNK


def test_a_fixed_chunk_is_kept_and_the_first_is_the_default():
    assert Admission(ctx=None, fixed_chunk=77).chunk(4, 4) == 77
    assert Admission(ctx=None).chunk(4, 0) == Admission(ctx=None).first_chunk


def test_a_wave_of_prompts_gets_its_first_tokens_group_by_group(tiny64, monkeypatch):
    """Nothing running, six prompts waiting: one iteration prefills them all, in forwards of about
    GROUP_TOKENS tokens, each handing out its first tokens before the next one runs; the output is
    the target's own."""
    monkeypatch.setattr(admission, "GROUP_TOKENS", 100)
    dec = SpecDecoder(tiny64, method="ragged", k=3)
    ctx = Context.of(tiny64, dec.proposer, 3, None)
    handed_out = []  # the rows of each call of the output processor with their first token only
    ctx.observe = lambda seqs: handed_out.append(sorted(s.index for s in seqs if len(s.generated) == 1))
    loop = Loop(ctx, RaggedBatch(ctx.models(), 8, 1024, ctx.k, ctx.pad_id, ctx.device))
    prompts = random_prompts(5, 6, 40, 41)
    seqs = dec.make_sequences(prompts, SamplingParams(max_new_tokens=12))  # indices 0..5
    for seq in seqs:
        loop.add(seq)
    loop.admission.admit(loop.batch)
    assert len(loop.batch) == 6 and not loop.waiting
    assert handed_out == [[0, 1, 2], [3, 4, 5]]  # 40 + 40 + 40 >= 100 tokens: a forward of three
    loop.run()
    assert [s.generated for s in seqs] == reference_tokens(tiny64, prompts, 12)


def test_a_longest_gap_bounds_every_chunk_idle_rows_or_not():
    adm = Admission(ctx=None, share=1.0, max_gap_s=0.5)
    for n in (16, 64, 256, 1024):
        adm.cost.observe(n, 0.05 + 0.001 * n)
    adm.observe_step(0.2)
    assert adm.chunk(running=8, idle=0) == 150  # the share's chunk is the smaller
    assert adm.chunk(running=1, idle=7) == 250  # (0.5 - 0.2 - 0.05) / 0.001, where it was unbounded
    adm.max_gap_s = 0.1  # less than a step and the fixed part: the least chunk worth a forward
    assert adm.chunk(running=8, idle=8) == 50
    assert Admission(ctx=None, max_gap_s=0.5).chunk(1, 4) == Admission(ctx=None).first_chunk  # nothing timed yet
    adm.max_gap_s, adm.gap_steps = 0.5, 2.0  # the gap: at most two 0.2 s steps
    assert adm.gap_s == 0.4 and adm.chunk(running=1, idle=7) == 150  # (0.4 - 0.2 - 0.05) / 0.001
    adm.gap_steps = 4.0  # four steps are more than 0.5 s: the bound in seconds holds
    assert adm.gap_s == 0.5 and adm.chunk(running=1, idle=7) == 250
    adm.max_gap_s = None  # the bound in steps alone (--max-itl-ms 0 --max-itl-steps 4)
    assert adm.gap_s == 0.8 and adm.chunk(running=1, idle=7) == 550
    assert Admission(ctx=None, gap_steps=4.0).gap_s is None  # no step measured yet: no bound in seconds


def test_riders_are_sized_by_the_riding_steps_own_cost():
    """Once every step carries a rider, the plain steps' average goes stale (40 ms timed with few rows,
    150 ms now): riders are sized by a fit of every step's seconds to the rider tokens it carried,
    its own part a and b a carried token, so the gap bounds the whole riding step, with a margin of
    twice the fit's RMS error. Before a rider is timed, a rider is sized as a forward of its own."""
    adm = Admission(ctx=None, max_gap_s=0.5)
    for n in (16, 64, 256, 1024):
        adm.cost.observe(n, 0.03 + 0.001 * n)  # a forward of its own: 30 ms and 1 ms a token
    adm.observe_step(0.04)
    assert (
        adm.chunk(running=8, idle=8, rides=True) == adm.chunk(running=8, idle=8) == 430
    )  # (0.5 - 0.04 - 0.03) / 0.001
    for n in (300, 100, 200, 400, 250, 150, 350) * 2:  # the batch grew: a 150 ms step, 0.5 ms a carried token
        if adm.rides_timed < admission.FIT_RIDES:  # a few riders timed: still sized as a forward of their own
            assert adm.chunk(running=8, idle=8, rides=True) == adm.chunk(running=8, idle=8)
        adm.observe_step(0.15 + 0.0005 * n, n)
    assert adm.step_s == 0.04 and abs(adm.step - 0.15) < 3e-3  # the plain average is stale, the fit is not
    assert 0 < adm.ride_error < 0.01**2  # the fit's misses, shrinking as it converges
    adm.ride_error = 0.0  # predicted exactly: the gap's room at b a token
    assert abs(adm.chunk(running=8, idle=8, rides=True) - 700) <= 6  # (0.5 - 0.15) / 0.0005
    adm.ride_error = 0.05**2  # predictions off by 50 ms: a margin of two such errors
    assert abs(adm.chunk(running=8, idle=8, rides=True) - 500) <= 6  # (0.5 - 0.15 - 0.1) / 0.0005
    assert abs(adm.chunk(running=8, idle=8) - 320) <= 3  # a forward of its own: (0.5 - 0.15 - 0.03) / 0.001
    assert adm.chunk(running=8, idle=0, rides=True) <= 700  # the share bounds it too


def test_a_carried_tokens_cost_is_bounded_by_a_prefilled_ones():
    """A riding fit of few steps, most carrying few tokens, can put a carried token at many times
    what a prefill forward spends on one: its share of a step (what the speculation policy learns
    the step less) and the riders it sizes use at most RIDER_COST_CAP x the prefill fit's b."""
    adm = Admission(ctx=None, max_gap_s=0.5)
    for n in (16, 64, 256, 1024):
        adm.cost.observe(n, 0.03 + 0.001 * n)  # 1 ms a prefilled token
    for n in (8, 16, 8, 16, 12):  # small riders on steps that swing with the rows: a steep fit
        adm.observe_step(0.1 + 0.009 * n, n)
    assert adm.riding.b > 4 * admission.RIDER_COST_CAP * adm.cost.b  # the fit alone: ~9 ms a token
    assert adm.rider_b == admission.RIDER_COST_CAP * adm.cost.b
    adm.ride_error = 0.0
    room = 0.5 - adm.step
    assert adm.chunk(running=8, idle=8, rides=True) == round(room / adm.rider_b)  # sized at the bound
    fresh = Admission(ctx=None, max_gap_s=0.5)  # no prefill timed yet: the riding fit as it is
    fresh.observe_step(0.1, 0)
    fresh.observe_step(0.2, 100)
    assert fresh.rider_b == fresh.riding.b


def test_a_riding_group_is_bounded_by_its_padded_tokens(tiny64, monkeypatch):
    """Whole prompts riding the step go as one padded batch: a group of a 20- and a 61-token prompt
    costs 2 x 61 tokens, more than the 90 the gap leaves, so they ride apart (by their prompt tokens,
    81, they would have gone together). The output is the reference's."""
    monkeypatch.setattr(admission, "carries", lambda target: True)  # an eager step: riders are fed in `settle`
    monkeypatch.setattr(Admission, "ride_prompts", True)
    dec = SpecDecoder(tiny64, method="ragged", k=3)
    ctx = Context.of(tiny64, dec.proposer, 3, None)
    loop = Loop(ctx, RaggedBatch(ctx.models(), 8, 2048, ctx.k, ctx.pad_id, ctx.device), max_gap_s=0.1)
    adm = loop.admission
    adm.cost.a, adm.cost.b, adm.step_s, adm.share = 0.0, 0.001, 0.01, 100.0  # 90 tokens fit beside a step
    adm.cost.observe = adm.observe_step = lambda *args: None
    shapes = []
    ride = adm._ride
    monkeypatch.setattr(
        adm, "_ride", lambda part, n, *a, **kw: (shapes.append((len(part), n)), ride(part, n, *a, **kw))
    )
    prompts = [random_prompts(3, 1, 10, 11)[0], random_prompts(4, 1, 20, 21)[0], random_prompts(5, 1, 60, 61)[0]]
    seqs = dec.make_sequences(prompts, SamplingParams(max_new_tokens=12))
    lengths = [len(seq) for seq in seqs]
    loop.add(seqs[0])
    loop.iterate()  # the first row runs
    loop.add(seqs[1])
    loop.add(seqs[2])
    loop.run()
    assert shapes == [(1, lengths[1]), (1, lengths[2])] and lengths[1:] == [20, 61]
    assert [s.generated for s in seqs] == reference_tokens(tiny64, prompts, 12)


def _burst(pair, max_gap_s, fitted_b=0.001, forwards=None, gap_steps=None, fitted_a=0.0, loops=None):
    """One running row, then six prompts of 100 tokens at once; the prompt tokens each iteration
    prefilled while the running row was waiting for its step (a fixed cost model: `fitted_b`
    seconds a token and `fitted_a` a forward, 10 ms a step; each forward is timed at 1 ms a token),
    and the outputs. `forwards`: a list that gets the prefill forwards each of those iterations ran;
    `loops`: one that gets the loop."""
    dec = SpecDecoder(pair, method="ragged", k=3)
    ctx = Context.of(pair, dec.proposer, 3, None)
    batch = RaggedBatch(ctx.models(), 8, 2048, ctx.k, ctx.pad_id, ctx.device)
    loop = Loop(ctx, batch, max_gap_s=max_gap_s, gap_steps=gap_steps)
    adm = loop.admission
    adm.cost.a, adm.cost.b, adm.step_s = fitted_a, fitted_b, 0.01
    if loops is not None:
        loops.append(loop)
    adm.cost.observe = adm.observe_step = lambda *args: None  # the costs stay as set
    fed = []
    original = adm._observe_prefill
    adm._observe_prefill = lambda tokens, seconds: (fed.append(tokens), original(tokens, 0.001 * tokens))
    prompts = [random_prompts(7, 1, 10, 11)[0], *random_prompts(8, 6, 100, 101)]
    seqs = dec.make_sequences(prompts, SamplingParams(max_new_tokens=40))
    loop.add(seqs[0])
    loop.iterate()  # the first row is running
    for seq in seqs[1:]:
        loop.add(seq)
    per_iteration = []
    while loop.busy:
        fed.clear()
        running = seqs[0] in loop.batch.seqs
        loop.iterate()
        if running:
            per_iteration.append(sum(fed))
            if forwards is not None:
                forwards.append(len(fed))
    return per_iteration, [s.generated for s in seqs], prompts


def test_a_burst_of_long_prompts_keeps_a_running_rows_gap_under_the_budget(tiny64):
    per_iteration, outputs, prompts = _burst(tiny64, max_gap_s=0.05)  # 40 tokens beside a 10 ms step
    assert max(per_iteration) <= 40 and sum(per_iteration) > 0
    assert outputs == reference_tokens(tiny64, prompts, 40)
    unbounded, _, _ = _burst(tiny64, max_gap_s=None)
    assert max(unbounded) >= 600  # without it, the whole burst in one iteration: a stall of 60 steps


def test_a_gap_in_steps_keeps_a_few_short_steps_from_waiting_on_a_long_chunk(tiny64):
    """A 0.5 s gap would let the whole burst in beside a 10 ms step; at most three steps' worth
    (30 ms) leaves 20 ms, 20 tokens, for prefill in each iteration the running row waits through."""
    per_iteration, outputs, prompts = _burst(tiny64, max_gap_s=0.5, gap_steps=3.0)
    assert max(per_iteration) <= 20 and sum(per_iteration) > 0
    assert outputs == reference_tokens(tiny64, prompts, 40)
    seconds_only, _, _ = _burst(tiny64, max_gap_s=0.5)
    assert max(seconds_only) >= 400


def test_a_chunk_the_step_cannot_carry_is_fed_alone_after_it(tiny64, monkeypatch):
    """Where the target's forward could carry a chunk but this step's does not (an eager target),
    the chunk is fed alone after the step (`settle`), at the size the gap allows a forward of its
    own, and the output is the reference's."""
    monkeypatch.setattr(admission, "carries", lambda target: True)
    loops = []
    offered, outputs, prompts = _burst(tiny64, max_gap_s=0.05, fitted_a=0.02, loops=loops)
    assert max(offered) == 20  # (40 ms - a) at 1 ms a token
    assert loops[0].admission.carried == 0 and loops[0].admission.chunks > 0
    assert outputs == reference_tokens(tiny64, prompts, 40)


def test_a_cost_fit_that_is_wrong_costs_at_most_one_forward_past_the_gap(tiny64):
    """The fit says prefill costs a hundredth of what the forwards take (few forwards timed, one-time
    costs): its token limit lets the whole burst in, but the measured seconds stop each iteration
    after its first forward, which already fills the gap."""
    forwards = []
    per_iteration, outputs, prompts = _burst(tiny64, max_gap_s=0.05, fitted_b=1e-5, forwards=forwards)
    assert forwards and max(forwards) == 1 and max(per_iteration) < 600  # 600: the whole burst at once
    assert outputs == reference_tokens(tiny64, prompts, 40)


def test_a_wave_at_an_idle_server_stops_once_its_first_rows_run(tiny64, monkeypatch):
    """Nothing running, six 40-token prompts: without a gap the whole wave is prefilled in one
    iteration (its first rows wait for the last); with one, the first forward starts rows and the
    iteration stops within the gap's tokens after it."""
    monkeypatch.setattr(admission, "GROUP_TOKENS", 80)
    fed = {}
    for gap in (None, 0.05):
        dec = SpecDecoder(tiny64, method="ragged", k=3)
        ctx = Context.of(tiny64, dec.proposer, 3, None)
        loop = Loop(ctx, RaggedBatch(ctx.models(), 8, 2048, ctx.k, ctx.pad_id, ctx.device), max_gap_s=gap)
        adm = loop.admission
        adm.cost.a, adm.cost.b, adm.step_s = 0.0, 0.001, 0.01
        adm.cost.observe = adm.observe_step = lambda *args: None
        prompts = random_prompts(9, 6, 40, 41)
        seqs = dec.make_sequences(prompts, SamplingParams(max_new_tokens=12))
        for seq in seqs:
            loop.add(seq)
        adm.admit(loop.batch)
        fed[gap] = len(loop.batch)
        loop.run()
        assert [s.generated for s in seqs] == reference_tokens(tiny64, prompts, 12)
    assert fed == {None: 6, 0.05: 2}  # a forward of two (80 tokens), then 40 tokens' room: no third prompt
