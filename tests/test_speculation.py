"""Adaptive speculation: output never depends on how many drafts a step verifies (any per-step
choice, early stops included, for every method, greedy and seeded sampling), and the `auto` policy
makes the choices its cost model and acceptance estimates call for: a plain step without calling
the proposer when verification cannot pay, wide steps when it can, estimates that learn."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

import batchspec.policy.speculation as speculation
from batchspec import SamplingParams, SpecDecoder
from batchspec.layouts.base import Layout
from batchspec.policy.costmodel import StepCost, features
from batchspec.policy.speculation import Adaptive, Speculation
from batchspec.proposers.base import Proposal
from batchspec.proposers.ngram import NgramProposer

METHODS = ("spec1", "eqspec", "exspec", "ragged")


class RandomK(Speculation):
    """A policy that asks for, stops at and verifies random numbers of drafts (seeded)."""

    def __init__(self, seed: int, k_max: int = 5, lazy: bool = False):
        self.rng, self.k_max, self.lazy, self.defer = random.Random(seed), k_max, lazy, False

    def plan(self, batch) -> int:
        return self.rng.choice([0, 1, self.k_max, self.rng.randint(1, self.k_max)])

    def stop_rule(self, batch, started):
        return lambda i, bins: self.rng.random() < 0.3

    def choose(self, batch, proposal, started) -> int:
        return self.rng.randint(0, proposal.drafts.shape[1])

    def observe(self, *args) -> None:
        pass

    def idle(self, stop=None) -> None:
        pass


def _decode(pair, prompts, params, policy=None, **config):
    dec = SpecDecoder(pair, check_invariants=True, **config)
    if policy is not None:
        dec.speculation = policy
    return [o.token_ids for o in dec.generate(prompts, params)], dec.stats


def test_random_policy_meets_the_protocol():
    assert isinstance(RandomK(0), Speculation)


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 7),
    batch=st.integers(1, 5),
    method=st.sampled_from(METHODS),
    proposer=st.sampled_from(["draft", "ngram"]),
)
def test_any_choice_of_k_per_step_equals_reference(tiny64, seed, n, batch, method, proposer):
    prompts = random_prompts(seed, n, 1, 40)
    got, stats = _decode(
        tiny64,
        prompts,
        SamplingParams(max_new_tokens=24),
        RandomK(seed),
        method=method,
        batch_size=batch,
        proposer=proposer,
        k=5,
    )
    assert got == reference_tokens(tiny64, prompts, 24)
    assert sum(stats.chosen_k.values()) == stats.row_steps


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 8),
    batch=st.integers(1, 5),
    proposer=st.sampled_from(["draft", "eagle"]),
    chunk=st.sampled_from([None, 5, 16]),
)
def test_lazy_policy_warms_the_draft_when_it_drafts(tiny64, seed, n, batch, proposer, chunk):
    """A lazy policy: rows are admitted (whole or in chunks) without the draft's prefill, and the
    ragged batch feeds the draft a row's tokens at the first step that drafts; the draft's cache is
    checked after every step (invariants) and the output equals the reference."""
    prompts = random_prompts(seed, n, 1, 40)
    got, _ = _decode(
        tiny64,
        prompts,
        SamplingParams(max_new_tokens=20),
        RandomK(seed, lazy=True),
        method="ragged",
        batch_size=batch,
        proposer=proposer,
        k=5,
        prefill_chunk=chunk,
    )
    assert got == reference_tokens(tiny64, prompts, 20)


class Never(RandomK):
    """A policy that never drafts."""

    def plan(self, batch) -> int:
        return 0


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lazy_policy_that_never_drafts_never_runs_the_draft(tiny64, lazy):
    """The k = 0 arm has no tax: under a lazy policy the draft model never runs, not even to
    prefill (an eager one prefills it at admission)."""
    dec = SpecDecoder(tiny64, method="ragged", batch_size=3, proposer="draft", k=4, check_invariants=True)
    dec.speculation = Never(0, lazy=lazy)
    calls = []
    hook = dec.proposer.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        prompts = random_prompts(5, 6, 2, 30)
        got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=12))]
    finally:
        hook.remove()
    assert got == reference_tokens(tiny64, prompts, 12)
    assert (len(calls) == 0) == lazy, len(calls)


@pytest.mark.parametrize("method", METHODS)
def test_any_choice_of_k_per_step_samples_like_reference(tiny64, method):
    prompts = random_prompts(8, 6, 1, 30)
    params = [SamplingParams(temperature=0.9, top_k=50, seed=s, max_new_tokens=20) for s in range(6)]
    ref = [o.token_ids for o in SpecDecoder(tiny64, method="reference").generate(prompts, params)]
    for seed in range(3):
        got, _ = _decode(tiny64, prompts, params, RandomK(seed), method=method, batch_size=3, k=5)
        assert got == ref


def _costs(per_token: float, fixed: float = 0.01) -> StepCost:
    """A cost model that has measured t = fixed + per_token x (B q) at every width."""
    points = [(b, q, s) for b in (1, 8) for q in range(1, 8) for s in (100, 1000)]
    return StepCost([(b, q, s, fixed + per_token * b * q) for b, q, s in points])


class _Spy(NgramProposer):
    def __init__(self, vocab):
        super().__init__(vocab)
        self.calls = 0

    def propose(self, *args, **kwargs):
        self.calls += 1
        return super().propose(*args, **kwargs)


def _adaptive(pair, proposer, step_cost, prop_cost=None) -> Adaptive:
    policy = Adaptive.__new__(Adaptive)
    Adaptive.__init__(policy, pair.target, proposer, 4)
    policy.step_cost = step_cost
    policy.prop_cost = prop_cost if prop_cost is not None else _costs(0.0, 1e-5)
    for cost in (policy.step_cost, policy.prop_cost):  # keep the given costs, not the tiny model's
        cost.observe = lambda *args: None
    return policy


def test_plain_steps_when_verification_cannot_pay(tiny64):
    """Each extra token per row costs as much as a whole step: a plain step is never beaten, so
    the proposer is never called and every step verifies nothing."""
    spy = _Spy(tiny64.vocab_size)
    policy = _adaptive(tiny64, spy, _costs(per_token=1.0, fixed=0.0))
    dec = SpecDecoder(tiny64, method="ragged", batch_size=4, k="auto", proposer="ngram")
    dec.proposer, dec.speculation = spy, policy
    prompts = [[5, 6, 7] * 10] * 4  # repetitive: lookup would find matches
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=16))
    assert spy.calls == 0
    assert set(dec.stats.chosen_k) == {0}
    assert [o.token_ids for o in outs] == reference_tokens(tiny64, prompts, 16)


def test_realised_rates_say_where_drafting_loses_by_bucket_of_rows():
    """Each step's tokens per second over a plain step's predicted rate, averaged per arm and bucket
    of rows: drafting loses where the steps that proposed realised less, once both arms are timed
    enough; other buckets are judged apart."""
    realised = speculation.Realised()
    for _ in range(speculation.REALISED_MIN[0]):  # plain steps of 12 rows at their predicted 0.1 s
        realised.observe(12, False, 12, 0.1, 0.1)
    for i in range(speculation.REALISED_MIN[1]):  # proposing: 1.44 tokens a row in 0.19 s (0.76x)
        assert not realised.loses(12)  # not timed enough yet
        realised.observe(15 - i % 3, True, round(1.44 * (15 - i % 3)), 0.19, 0.1)
    assert realised.loses(12) and realised.loses(8) and not realised.loses(16) and not realised.loses(7)
    for _ in range(20):  # drafting got better: its average passes the plain steps'
        realised.observe(12, True, 24, 0.12, 0.1)
    assert not realised.loses(12)
    assert set(realised.describe()["rows 8-15"]) == {"plain", "proposed"}


def test_plain_steps_where_the_clock_says_drafting_loses(tiny64):
    """The cost model says verifying pays, but the steps that proposed realised less than plain
    ones at these rows: the steps are plain but for an exploring draft every EXPLORE_EVERY steps;
    exact against the reference."""
    spy = _Spy(tiny64.vocab_size)
    policy = _adaptive(tiny64, spy, _costs(per_token=1e-4))  # verifying looks almost free
    policy.realised.arms = {(1, False): (1.0, 5), (1, True): (0.5, 20)}
    policy.realised.observe = lambda *args: None  # keep the verdict: the tiny model's clock would not
    dec = SpecDecoder(tiny64, method="ragged", batch_size=1, k="auto", proposer="ngram")
    dec.proposer, dec.speculation = spy, policy
    prompts = [[5, 6, 7] * 10]  # repetitive: lookup finds matches
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    outs = dec.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference_tokens(tiny64, prompts, 100)
    steps = sum(dec.stats.chosen_k.values())
    assert 1 <= spy.calls <= steps // (speculation.EXPLORE_EVERY + 1) + 1
    policy.realised.arms = {}  # nothing measured: the cost model decides, and drafting pays
    dec.generate(prompts, params)
    assert spy.calls > steps // 2


def test_drafts_where_the_clock_says_proposing_wins(tiny64):
    """The cost model says verifying never pays, but the steps that proposed realised more than
    plain ones at these rows: most steps propose, and those with drafts verify them (the model
    alone verifies only to explore, one step in EXPLORE_EVERY); exact against the reference."""
    spy = _Spy(tiny64.vocab_size)
    policy = _adaptive(tiny64, spy, _costs(per_token=1.0, fixed=0.0))  # every extra token: a whole step
    policy.realised.arms = {(1, False): (0.5, 5), (1, True): (1.0, 20)}
    policy.realised.observe = lambda *args: None
    dec = SpecDecoder(tiny64, method="ragged", batch_size=1, k="auto", proposer="ngram")
    dec.proposer, dec.speculation = spy, policy
    prompts = [[5, 6, 7] * 10]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    outs = dec.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference_tokens(tiny64, prompts, 100)
    steps = sum(dec.stats.chosen_k.values())
    verified = sum(n for k, n in dec.stats.chosen_k.items() if k > 0)  # lookup finds no match in some steps
    assert spy.calls > steps // 2 and verified > 3 * (steps // (speculation.EXPLORE_EVERY + 1) + 1)


def test_explores_when_estimates_keep_it_from_verifying(tiny64):
    """Verification never pays by the costs it knows: still, after EXPLORE_EVERY steps without a
    verified draft, one step verifies one draft (and no more often)."""
    spy = _Spy(tiny64.vocab_size)
    policy = _adaptive(tiny64, spy, _costs(per_token=1.0, fixed=0.0))
    dec = SpecDecoder(tiny64, method="ragged", batch_size=1, k="auto", proposer="ngram")
    dec.proposer, dec.speculation = spy, policy
    prompts = [[5, 6, 7] * 10]  # repetitive: lookup finds matches
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    outs = dec.generate(prompts, params)
    ref = SpecDecoder(tiny64, method="reference").generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] and len(ref[0].token_ids) == 100
    steps = sum(dec.stats.chosen_k.values())
    assert dec.stats.chosen_k.get(1, 0) == spy.calls >= 2
    assert spy.calls <= steps // (speculation.EXPLORE_EVERY + 1) + 1
    assert set(dec.stats.chosen_k) == {0, 1}


def test_explores_a_plain_step_when_it_always_verifies(tiny_same):
    """Verification costs nothing by the costs it knows and every draft is right: still, after
    EXPLORE_EVERY steps that all verified (REALISED_EXPLORE for the first REALISED_MIN plain steps
    of a bucket of rows), one step is plain (no proposer call; no more often), so the plain step's
    cost is measured at the batch's shape now."""
    dec = SpecDecoder(tiny_same, method="ragged", batch_size=1, k="auto", proposer="draft")
    dec.speculation = _adaptive(tiny_same, dec.proposer, _costs(per_token=1e-9, fixed=0.01))
    dec.speculation.realised.loses = lambda rows: False  # its draft is as deep as the target: the clock may say so
    calls, propose = [], dec.proposer.propose
    dec.proposer.propose = lambda *args: calls.append(1) or propose(*args)
    prompts = random_prompts(5, 1, 5, 20)
    params = SamplingParams(max_new_tokens=600, ignore_eos=True)
    outs = dec.generate(prompts, params)
    ref = SpecDecoder(tiny_same, method="reference").generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref] and len(ref[0].token_ids) == 600
    steps = sum(dec.stats.chosen_k.values())
    plain = steps - len(calls)  # steps the policy planned plain
    assert steps > 2 * (speculation.EXPLORE_EVERY + 1)
    first = speculation.REALISED_MIN[0]
    assert first + 1 <= plain <= first + steps // (speculation.EXPLORE_EVERY + 1) + 1
    assert dec.stats.chosen_k[0] == plain and dec.speculation.realised.count(1, False) == plain


@pytest.mark.parametrize("draft_ms", [12.0, 0.1])
def test_a_draft_that_costs_a_whole_step_never_runs(tiny_same, draft_ms):
    """A draft model whose forward costs more than a plain target step (a self-draft as deep as
    the target, say) cannot pay even if every draft is accepted: auto never drafts, explores or
    feeds it a prompt, however long it runs. A cheap one (the control) does run."""
    dec = SpecDecoder(tiny_same, method="ragged", batch_size=2, k="auto", proposer="draft")
    step = _costs(per_token=1e-4, fixed=0.01)  # a plain step: ~10 ms; each verified column 0.1 ms more
    dec.speculation = _adaptive(tiny_same, dec.proposer, step, _costs(per_token=0.0, fixed=draft_ms / 1000))
    calls = _draft_forwards(dec, tiny_same, random_prompts(7, 2, 5, 20), 3 * speculation.EXPLORE_EVERY)
    assert (calls == 0) == (draft_ms == 12.0), calls


@pytest.mark.parametrize("warm_s_per_token", [1.0, 0.0])
def test_a_draft_is_not_fed_prompts_that_drafting_cannot_pay_back(tiny_same, warm_s_per_token):
    """A heavy draft (a forward a third of a plain step) pays a little per step, but feeding it the
    rows it lacks (`warm`) costs a second per token, more than drafting could save over the rows'
    remaining tokens: auto plans plain steps and never feeds or runs the draft. When feeding is
    free (the control) it drafts."""
    dec = SpecDecoder(tiny_same, method="ragged", batch_size=2, k="auto", proposer="draft")
    dec.speculation = _adaptive(tiny_same, dec.proposer, _costs(per_token=1e-3), _costs(0.0, fixed=4e-3))
    dec.speculation.warm_rate = warm_s_per_token  # as if timed in an earlier feed
    dec.speculation.warmed = lambda tokens, seconds: None  # keep it
    calls = _draft_forwards(dec, tiny_same, random_prompts(8, 3, 5, 20), 2 * speculation.EXPLORE_EVERY)
    assert (calls == 0) == (warm_s_per_token == 1.0), calls


@pytest.mark.parametrize("warm_s_per_token", [1e-6, 1.0])
def test_a_heavy_draft_explores_when_its_feed_is_cheap(tiny_same, warm_s_per_token):
    """A heavy draft whose acceptance, as first estimated, never pays (a plain step is always the
    best bet) while every row arrives cold: when feeding it a row costs about nothing (the target's
    own copy adopts the target's entries) an exploring step feeds and tests it, learns that every
    draft is right, and drafts from then on. A feed dearer than a plain step (the control) is
    never taken to explore."""
    dec = SpecDecoder(tiny_same, method="ragged", batch_size=1, k="auto", proposer="draft")
    dec.speculation = _adaptive(tiny_same, dec.proposer, _costs(per_token=3e-3), _costs(0.0, fixed=4e-3))
    dec.speculation.warm_rate = warm_s_per_token  # as if timed in an earlier feed
    dec.speculation.warmed = lambda tokens, seconds: None  # keep it
    calls = _draft_forwards(dec, tiny_same, random_prompts(9, 3, 5, 20), 3 * speculation.EXPLORE_EVERY)
    if warm_s_per_token == 1.0:
        assert calls == 0
    else:
        assert calls > speculation.EXPLORE_EVERY, calls  # explored, then drafted


def _draft_forwards(dec, pair, prompts, max_new_tokens: int) -> int:
    """Decode `prompts` with `dec` (greedy, EOS ignored), check the output is the reference's, and
    return how many forwards its draft model ran."""
    calls = []
    hook = dec.proposer.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        got = [o.token_ids for o in dec.generate(prompts, params)]
    finally:
        hook.remove()
    ref = SpecDecoder(pair, method="reference").generate(prompts, params)
    assert got == [o.token_ids for o in ref]
    return len(calls)


def test_wide_steps_when_verification_is_nearly_free(tiny_same):
    """Verification costs almost nothing beyond a plain step and the draft (the target itself)
    is always right: the policy learns it and verifies the most drafts."""
    dec = SpecDecoder(tiny_same, method="ragged", batch_size=4, k="auto", proposer="draft")
    dec.speculation = _adaptive(tiny_same, dec.proposer, _costs(per_token=1e-6, fixed=0.01))
    prompts = random_prompts(3, 4, 5, 20)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=40))
    assert [o.token_ids for o in outs] == reference_tokens(tiny_same, prompts, 40)
    hist = dec.stats.chosen_k
    assert max(hist) == speculation.AUTO_K_MAX and hist[speculation.AUTO_K_MAX] > sum(hist.values()) / 2
    assert dec.speculation.any_bin[0] > 0.9  # every draft accepted: learned (prior 0.5)
    report = dec.stats.summary()["speculation"]
    assert set(report["step_cost"]["1"]) == {"fixed_ms", "per_row_ms", "per_row_per_1k_span_ms", "scale"}
    assert report["acceptance_any_bin"][0] > 0.9


def test_choice_follows_the_acceptance_estimates(tiny64):
    """With a moderate verify cost, rows whose drafts are likely right get wide steps and rows
    without a lookup match none."""
    policy = _adaptive(tiny64, NgramProposer(tiny64.vocab_size), _costs(per_token=0.002, fixed=0.01))

    class Batch(Layout):
        seqs = [type("S", (), {"__len__": lambda self: 50})() for _ in range(4)]

    drafts = torch.zeros(4, 6, dtype=torch.long)
    likely = Proposal(drafts, torch.tensor([6, 6, 6, 6]), torch.full((4, 6), 3))
    policy.table[3] = 0.95
    assert policy.choose(Batch(), likely, started=time.perf_counter()) == 6
    none = Proposal(drafts, torch.tensor([0, 0, 0, 0]), torch.zeros(4, 6, dtype=torch.long))
    assert policy.choose(Batch(), none, started=time.perf_counter()) == 0
    policy.table[1] = 0.05
    unlikely = Proposal(drafts, torch.tensor([6, 6, 6, 6]), torch.full((4, 6), 1))
    assert policy.choose(Batch(), unlikely, started=time.perf_counter()) == 0


def test_never_verifies_a_column_no_row_drafted(tiny64):
    """Wider verifies predicted cheaper than narrow ones (a noisy fit at B = 1 can say so): the
    width still stops at the longest real proposal, and a step with none is plain."""
    points = [(b, q, s) for b in (1, 8) for q in range(1, 8) for s in (100, 1000)]
    cheaper_wide = StepCost([(b, q, s, 0.05 - 0.005 * q) for b, q, s in points])
    policy = _adaptive(tiny64, NgramProposer(tiny64.vocab_size), cheaper_wide)
    policy.table[:] = 0.9

    class Batch(Layout):
        seqs = [type("S", (), {"__len__": lambda self: 50})() for _ in range(2)]

    drafts, signal = torch.zeros(2, 6, dtype=torch.long), torch.full((2, 6), 3)
    assert policy.choose(Batch(), Proposal(drafts, torch.tensor([2, 1]), signal), time.perf_counter()) == 2
    assert policy.choose(Batch(), Proposal(drafts, torch.tensor([0, 0]), signal), time.perf_counter()) == 0
    assert policy.choose(Batch(), Proposal(drafts, None, signal), time.perf_counter()) == 6


def test_cost_fit_recovers_each_widths_cost():
    true = {q: (0.02 * q, 0.001 * q**0.5, 0.0005 * q) for q in (1, 2, 5)}  # widths need not be smooth
    cost = lambda b, q, s: sum(c * f for c, f in zip(true[q], features(b, s)))  # noqa: E731
    model = StepCost([(b, q, s, cost(b, q, s)) for q in true for b in (1, 4, 16) for s in (10, 500, 2000)])
    for b, q, s in [(2, 2, 100), (8, 5, 1500), (3, 1, 700)]:
        assert model(b, q, s) == pytest.approx(cost(b, q, s), rel=1e-6)
    for _ in range(200):  # steps at width 1 cost twice their probe: the machine slowed down, say
        model.observe(8, 1, 500, 2 * cost(8, 1, 500))
    assert model(8, 1, 500) == pytest.approx(2 * cost(8, 1, 500), rel=1e-3)
    assert model(8, 2, 500) == pytest.approx(2 * cost(8, 2, 500), rel=1e-2)  # one load for all
    assert model(1, 5, 3000) == pytest.approx(2 * cost(1, 5, 3000), rel=1e-2)
    assert set(model.describe()) == {"1", "2", "5", "load"}


def test_each_width_learns_what_the_shared_load_leaves():
    """Plain steps cost their probe, 5-token verifies 1.5x theirs: the shared load cannot fit
    both, each width's scale takes the rest, so the model's ratio of the two tends to the true one."""
    model = StepCost([(b, q, s, 0.01 + 0.002 * b * q) for q in (1, 5) for b in (1, 4, 16) for s in (10, 500)])
    truth = {1: lambda b: 0.01 + 0.002 * b, 5: lambda b: 1.5 * (0.01 + 0.01 * b)}
    for i in range(400):
        q = 1 if i % 2 else 5
        model.observe(8, q, 300, truth[q](8))
    for q in (1, 5):
        assert model(8, q, 300) == pytest.approx(truth[q](8), rel=0.05)
    assert model.describe()["5"]["scale"] > model.describe()["1"]["scale"]


def test_a_width_timed_rarely_learns_its_cost_from_its_first_steps():
    """A policy that nearly always verifies: 2-token steps take 1.5x their probe, the plain step
    (timed once per 32 steps, as the policy explores it) its probe. After one plain step its
    estimate is its own, not the load that the verifies taught (1.5x)."""
    probe = lambda b, q: 0.03 + 0.002 * b * q  # noqa: E731
    model = StepCost([(b, q, s, probe(b, q)) for q in (1, 2) for b in (1, 4, 16) for s in (10, 500)])
    for i in range(64):
        if i == 32:
            model.observe(9, 1, 300, probe(9, 1))
        model.observe(9, 2, 300, 1.5 * probe(9, 2))
    assert model(9, 1, 300) == pytest.approx(probe(9, 1), rel=0.1)
    assert model(9, 2, 300) == pytest.approx(1.5 * probe(9, 2), rel=0.1)


def test_cost_model_does_not_extrapolate_recent_batch_shapes():
    """Timed steps that all share one batch shape (8 rows, short spans; 10% slower than probed,
    with noise) leave the predictions elsewhere (one row, a long span) within the noise of the
    truth: the learned corrections are factors, not a fit of the few shapes seen."""
    probe = lambda b, q, s: 0.03 + 0.002 * b * q + 0.004 * b * s / 1000  # noqa: E731
    model = StepCost([(b, q, s, probe(b, q, s)) for q in (1, 5) for b in (1, 8) for s in (64, 768)])
    rng = random.Random(0)
    for i in range(300):
        rows, span = (8, rng.randint(50, 300)) if i < 290 else (rng.randint(5, 7), rng.randint(300, 900))
        q = 1 + 4 * (i % 3 == 0)
        model.observe(rows, q, span, 1.1 * probe(rows, q, span) * rng.uniform(0.9, 1.1))
    for rows, q, span in [(1, 1, 1500), (5, 1, 943), (2, 5, 1200)]:
        assert model(rows, q, span) == pytest.approx(1.1 * probe(rows, q, span), rel=0.25)


def test_a_cost_without_probes_is_fitted_on_the_steps():
    """A lookup proposer has no probe: its cost is fitted (non-negative) on its timed calls."""
    model = StepCost([])
    assert model(4, 1, 100) == 0.0
    for rows in (1, 2, 4, 8) * 4:
        model.observe(rows, 1, 100, 0.0003 + 0.0001 * rows)
    assert model(6, 1, 100) == pytest.approx(0.0009, rel=1e-3)


def test_proposer_cost_learns_per_model_forward(tiny64):
    """A model proposer's cost is learned per forward: a proposal that says it took none (a
    combined proposer's lookup-only step) teaches nothing; one that took one per draft does."""
    policy = Adaptive(
        tiny64.target, SimpleNamespace(model=tiny64.draft, bins=2, branches=1, kv_from_target=False), capacity=4
    )
    learned = []
    policy.prop_cost.observe = lambda rows, q, span, seconds: learned.append(seconds)
    drafts = torch.zeros(2, 3, dtype=torch.long)
    signal = torch.zeros(2, 3, dtype=torch.long)
    policy.observe([], Proposal(drafts, None, signal, forwards=0), 0, [0, 0], 1e-5, 0.01, 20)
    assert learned == []
    policy.observe([], Proposal(drafts, None, signal), 0, [0, 0], 0.03, 0.01, 20)
    assert learned == [pytest.approx(0.01)]
