"""`--draft self` / `--draft-quant`: the target's own weights, weight-only quantized, as the draft
model; the output is the target's own in every method, and bad options are refused clearly."""

from __future__ import annotations

import json
import types

import psutil
import pytest
import torch
from helpers import assert_drafted_exactly, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import BatchspecError, SamplingParams, SpecDecoder, load_pair, tiny_pair
from batchspec.cli import main
from batchspec.core.config import EngineConfig
from batchspec.models.linears import TunedLinear
from batchspec.models.quant import DENSE_ROWS, QuantLinear, quantize
from batchspec.policy import costmodel, drafter


@pytest.fixture(scope="module")
def self_pairs():
    """The float64 tiny target with its own copy as the draft, per quantization."""
    return {q: load_pair("tiny", dtype="float64", draft="self", draft_quant=q) for q in ("int8", "int4", "none")}


def test_the_self_draft_is_a_quantized_copy_sharing_only_the_embedding(self_pairs):
    pair = self_pairs["int8"]
    target, draft = pair.target, pair.draft
    assert draft is not target and pair.default_proposer == "draft" and pair.draft_vocab_ids is None
    layers = [m for m in draft.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.kind == "int8" and m.packed.dtype == torch.int8 for m in layers)
    assert not any(isinstance(m, (torch.nn.Linear, TunedLinear)) for m in draft.modules())
    # The target is untouched: its own linear layers, its float64 parameters.
    assert any(isinstance(m, TunedLinear) for m in target.modules())
    assert all(p.dtype == torch.float64 for p in target.parameters())
    shared = {id(p) for p in target.parameters()} & {id(p) for p in draft.parameters()}
    assert shared == {id(target.get_input_embeddings().weight)}
    info = pair.describe()
    assert info["draft"]["bytes"] < info["target"]["bytes"] / 4  # int8 against float64, embedding shared
    assert info["draft_dtype"] in ("bfloat16", "float32") and "self (int8)" in info["pair"]


def test_int4_layers_are_int4_where_the_width_allows_but_the_head_is_int8(self_pairs):
    draft = self_pairs["int4"].draft
    head = draft.get_output_embeddings()
    kinds = {m.kind for m in draft.modules() if isinstance(m, QuantLinear) and m is not head}
    assert kinds == {"int4"}  # the tiny model's widths are multiples of 32
    assert isinstance(head, QuantLinear) and head.kind == "int8"
    odd = QuantLinear(torch.randn(8, 48), None, "int4")
    assert odd.kind == "int8"  # 48 inputs: no whole group of 32


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_layer_approximates_its_weight_in_both_paths(kind):
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 64)
    quant = QuantLinear(layer.weight, layer.bias, kind)
    x = torch.randn(DENSE_ROWS + 8, 128)
    few, many = quant(x[:4]), quant(x)[:4]  # the kernel's path, and the dequantized product's
    want = layer(x[:4])
    tol = 0.05 if kind == "int8" else 0.25
    assert few.dtype == many.dtype == torch.float32
    assert (few - want).abs().max() < tol * want.abs().max()
    assert (few - many).abs().max() < 0.02 * want.abs().max()


@given(
    seed=st.integers(0, 10**6),
    quant=st.sampled_from(["int8", "int4", "none"]),
    method=st.sampled_from(["ragged", "eqspec", "exspec"]),
    proposer=st.sampled_from(["draft", "ngram+draft"]),
    k=st.integers(1, 4),
    batch_size=st.integers(1, 4),
    branches=st.sampled_from([1, 1, 2]),
)
def test_the_self_draft_leaves_the_output_exact(
    self_pairs, tiny64, seed, quant, method, proposer, k, batch_size, branches
):
    assert_drafted_exactly(
        self_pairs[quant], tiny64, seed, method, branches, proposer=proposer, k=k, batch_size=batch_size
    )


def test_the_self_draft_accepts_most_drafts(self_pairs):
    """A copy of the target drafts what the target picks: with int8 weights nearly every draft is
    accepted (the tiny pair's own draft model, a noisy copy, far fewer)."""
    prompts = random_prompts(3, 4, 4, 30)
    dec = SpecDecoder(self_pairs["int8"], method="ragged", proposer="draft", k=4, batch_size=4)
    dec.generate(prompts, SamplingParams(max_new_tokens=24))
    assert dec.stats.summary()["mean_accepted"] > 3.0


def test_the_default_pairs_self_draft_is_exact(default_pair):
    pair = load_pair("default", dtype="float32", draft="self")
    assert pair.head is not None and pair.default_proposer == "draft"
    prompts, params = ["Why is the sky blue?", "List three prime numbers."], SamplingParams(max_new_tokens=12)
    want = [o.token_ids for o in SpecDecoder(default_pair, method="ar").generate(prompts, params)]
    for method in ("ragged", "eqspec"):
        dec = SpecDecoder(pair, method=method, proposer="draft", k=3, batch_size=2)  # invariants: on the tiny pairs
        assert [o.token_ids for o in dec.generate(prompts, params)] == want, method


def test_bad_self_draft_options_are_refused(tmp_path):
    with pytest.raises(BatchspecError, match="unknown draft quantization 'int3'"):
        load_pair("tiny", draft="self", draft_quant="int3")
    with pytest.raises(BatchspecError, match="--draft self with --tp is not supported"):
        load_pair("tiny", draft="self", tp_size=2)
    with pytest.raises(BatchspecError, match="not both"):
        load_pair("tiny", draft=str(tmp_path))
    with pytest.raises(BatchspecError, match="runs on CPUs only"):
        quantize(torch.nn.Linear(4, 4, device="meta"), "int8")
    with pytest.raises(BatchspecError, match="unknown draft quantization"):
        quantize(torch.nn.Linear(4, 4), "fp8")


def test_draft_quant_without_a_draft_model_is_refused_before_loading(tmp_path):
    with pytest.raises(BatchspecError, match="--draft-quant int8 needs a draft model"):
        load_pair(target=str(tmp_path / "no-such-model"), draft_quant="int8")


def test_cli_self_draft(tmp_path):
    out = tmp_path / "g.json"
    args = ["generate", "--pair", "tiny", "--draft", "self", "--draft-quant", "int4", "--proposer", "draft", "-k", "3"]
    assert main([*args, "--max-new-tokens", "6", "--quiet", "--json", str(out), "hello"]) == 0
    report = json.loads(out.read_text())
    assert "self (int4)" in report["models"]["pair"] and report["models"]["draft"]["bytes"] > 0


@pytest.mark.parametrize(
    "method, proposer, k",
    [("ragged", "draft", 3), ("ragged", "ngram+draft", 2), ("eqspec", "draft", 3), ("exspec", "draft", 2)],
)
def test_the_self_drafts_cache_starts_from_the_targets(self_pairs, tiny64, method, proposer, k):
    """The target's own copy is never fed a prompt: its cache takes the target's entries of the
    committed tokens (the ragged layout's warm, the padded layouts' prefill; the invariant checker
    accepts, position by position, the draft's entry or the target's), and its drafts are still
    accepted."""
    prompts = random_prompts(11, 4, 30, 40)
    dec = SpecDecoder(self_pairs["int8"], method=method, proposer=proposer, k=k, batch_size=4, check_invariants=True)
    assert dec.proposer.kv_from_target
    drafter = dec.proposer.inner if proposer == "ngram+draft" else dec.proposer
    fed, feed = [], drafter._feed
    drafter._feed = lambda batch, ids, *rest: fed.append(ids.shape[1]) or feed(batch, ids, *rest)
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=16))]
    assert got == reference_tokens(tiny64, prompts, 16)
    assert fed and max(fed) < 30  # no forward took a prompt (each at least 30 tokens)
    assert dec.stats.summary()["mean_accepted"] > k / 2


@pytest.mark.parametrize("shape", [(128, 64), (192, 96), (48, 64)])  # 48 outputs: not whole blocks of 64
def test_the_dequantized_int4_weight_is_the_kernels_own(shape):
    """The weight a prompt's dense product uses, unpacked by bit shifts, is the kernel's: its
    product with the identity, to the bit."""
    torch.manual_seed(1)
    layer = QuantLinear(torch.randn(*shape), None, "int4")
    eye = torch.eye(shape[1], dtype=torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group, layer.scales).T
    assert layer.kind == "int4" and torch.equal(layer.dense(), want)


def test_a_quantized_draft_keeps_its_dense_weights_but_a_self_draft_does_not(self_pairs):
    """`quantize` (a draft model's --draft-quant) keeps each layer's dequantized weight once a
    prompt made it; the target's own copy (its prompts adopt the target's entries) keeps none."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    model.get_output_embeddings = lambda: model[1]
    quantize(model, "int4")
    model(torch.randn(DENSE_ROWS + 1, 64))
    assert all(layer.kept is not None for layer in model)
    assert not any(m.keep_dense for m in self_pairs["int4"].draft.modules() if isinstance(m, QuantLinear))


def _user_target(monkeypatch):
    """A user's --target, as `_load_spec_pair` returns it: the tiny target, no draft model."""
    from batchspec.models import pair as pair_module

    def load(target, draft, dtype, tp_size=1):
        assert draft is None
        made = pair_module.tiny_pair(dtype=dtype)
        made.draft, made.head, made.default_proposer = None, None, "ngram"
        return made

    monkeypatch.setattr(pair_module, "_load_spec_pair", load)
    return pair_module


def _fake_costs(copy_pays: bool) -> drafter.Costs:
    """A cost table (seconds): a plain step of 40 ms, verifies that grow 10% a token, and a copy
    whose forward is 4 ms (pays) or 40 ms (as dear as the target: cannot)."""
    return drafter.Costs(tuple(0.04 * (1 + 0.1 * j) for j in range(6)), 0.004 if copy_pays else 0.04)


@pytest.mark.parametrize(
    ("verify", "draft", "want"),
    [
        ((0.04, 0.044, 0.048, 0.052), 0.004, "draft"),  # a copy a tenth of a step: pays
        ((0.04, 0.044, 0.048, 0.052), 0.04, "ngram"),  # as dear as the target: lookup
        ((0.04, 0.08, 0.12, 0.16), 0.004, "ngram"),  # verifying is compute-bound: nothing pays
        ((0.04, 0.046), 0.01, "draft"),  # one draft, at a quarter of a step: 1.9 / 1.36 of a step's tokens
    ],
)
def test_the_drafter_is_chosen_from_the_cost_table(verify, draft, want):
    name, why = drafter.decide(drafter.Costs(verify, draft))
    gain, _ = drafter.copy_gain(drafter.Costs(verify, draft))
    assert name == want and (gain > drafter.LOOKUP_GAIN) == (want == "draft")
    assert why.startswith("auto: ") and f"{1e3 * draft:.1f} ms" in why


@pytest.mark.parametrize("copy_pays", [True, False])
def test_auto_runs_what_the_measured_costs_choose_and_stays_exact(monkeypatch, copy_pays):
    """--draft auto (the command line's default beside --target) builds the target's own int4 copy
    as a candidate; the decoder runs the copy or lookup as the cost table says, names the choice
    in its start-up report, and is exact either way. Without a fake table the costs are measured."""
    _user_target(monkeypatch)
    pair = load_pair(target="user-model", draft="auto", dtype="float32")
    assert pair.draft_candidate and pair.default_proposer == "draft" and pair.draft_copies_target
    assert {m.kind for m in pair.draft.modules() if isinstance(m, QuantLinear)} >= {"int4"}
    assert "measured costs" in pair.startup["drafter"] and pair.describe()["drafter"] == pair.startup["drafter"]
    measured = []
    real = drafter.measure
    monkeypatch.setattr(drafter, "measure", lambda *a: measured.append(real(*a)) or _fake_costs(copy_pays))
    prompts = random_prompts(3, 3, 4, 30)
    dec = SpecDecoder(pair, method="ragged", batch_size=3, k="auto")
    assert dec.proposer_name == ("draft" if copy_pays else "ngram")
    assert dec.startup["drafter"].startswith("auto: the target's own copy" if copy_pays else "auto: lookup alone")
    assert measured and all(t > 0 for t in measured[0].verify) and measured[0].draft > 0
    got = dec.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in got] == reference_tokens(pair, prompts, 24)
    assert dec.stats.extra["startup"]["drafter"] == dec.startup["drafter"]


def test_bench_chooses_per_batch_size_and_reports_the_choice(monkeypatch, tmp_path):
    """The choice is made for each batch size from its own costs (here: the copy pays at one row,
    not at three), and bench's JSON says per run which drafter ran and why."""
    from batchspec.tools.bench import bench

    _user_target(monkeypatch)
    pair = load_pair(target="user-model", draft="auto", dtype="float32")
    monkeypatch.setattr(drafter, "measure", lambda config, *a: _fake_costs(config.batch_size == 1))
    prompts = random_prompts(6, 3, 4, 20)
    report = bench(pair, prompts, ["ar", "ragged"], [1, 3], SamplingParams(max_new_tokens=8), progress=False)
    runs = {r["batch_size"]: r for r in report["runs"] if r["method"] == "ragged"}
    assert runs[1]["proposer"] == "draft" and runs[1]["drafter"].startswith("auto: the target's own copy")
    assert runs[3]["proposer"] == "ngram" and runs[3]["drafter"].startswith("auto: lookup alone")


def test_costs_from_the_tuning_cache_are_put_at_the_machines_speed_now(monkeypatch):
    """A model whose probes came from the disk cache (maybe a faster day) has its costs scaled by a
    forward timed now over the fit's, once per model and rows; probes taken in this process are
    used as they are. So a candidate probed today is not weighed against a target cached faster."""
    pair = tiny_pair()
    config = EngineConfig(batch_size=2, k="auto")
    monkeypatch.setattr(costmodel, "from_disk", lambda *a: False)
    fresh = drafter.measure(config, pair.target, pair.draft)
    timed = []

    def slow(model, rows, q, span, repeats=1, warmup=True):  # this machine at half the cached speed
        timed.append(model)
        cost = drafter.StepCost(drafter.probe(model, rows, 1 if model is pair.draft else len(fresh.verify)))
        return 2.0 * cost(rows, 1, span)

    monkeypatch.setattr(costmodel, "from_disk", lambda model, *a: model is pair.target)
    monkeypatch.setattr(costmodel, "time_forward", slow)
    cached = drafter.measure(config, pair.target, pair.draft)
    assert cached.verify == pytest.approx(tuple(2.0 * t for t in fresh.verify))
    assert cached.draft == pytest.approx(fresh.draft) and timed == [pair.target]
    drafter.measure(config, pair.target, pair.draft)
    assert timed == [pair.target]  # once per model and rows


def test_the_copys_measured_acceptance_revises_the_choice():
    costs = _fake_costs(copy_pays=True)  # chosen at the guessed 0.9: about 2x a plain step
    assert drafter.revise(costs, drafter.REVISE_AFTER - 1, 0.1) is None  # too few drafts tested to say
    assert drafter.revise(costs, 500, 0.9) is None
    why = drafter.revise(costs, 500, 0.3)  # 0.3: the copy at best 1.08x, under lookup's bar
    assert why.startswith("auto: lookup alone, switched from the copy after 500 drafts accepted at 0.30")


def _two_runs_with_the_copy(monkeypatch, prompts, new: int) -> SpecDecoder:
    """A decoder over a user's target with --draft auto, the copy chosen by a fake cost table, run
    twice on `prompts`, exact against the reference each time; `dec.ran`: the proposer of each run."""
    _user_target(monkeypatch)
    pair = load_pair(target="user-model", draft="auto", dtype="float32")
    monkeypatch.setattr(drafter, "measure", lambda *a: _fake_costs(copy_pays=True))
    dec = SpecDecoder(pair, method="ragged", batch_size=3, k="auto")
    dec.ran = []
    for _ in range(2):
        dec.ran.append(dec.proposer_name)
        got = dec.generate(prompts, SamplingParams(max_new_tokens=new))
        assert [o.token_ids for o in got] == reference_tokens(pair, prompts, new)
    return dec


@pytest.mark.parametrize("accepted", [0.3, 0.95])
def test_a_decoder_switches_to_lookup_when_the_copy_is_accepted_too_rarely(monkeypatch, accepted):
    """After a run with the copy, the acceptance the policy measured replaces the guess: at 0.3 the
    next run uses lookup alone (and says why), at 0.95 the copy stays; every run is exact."""
    from batchspec.policy.speculation import Adaptive

    monkeypatch.setattr(Adaptive, "acceptance", lambda self: (200.0, accepted))
    dec = _two_runs_with_the_copy(monkeypatch, random_prompts(7, 3, 4, 30), 16)
    assert dec.ran == ["draft", "draft" if accepted > 0.5 else "ngram"]
    assert dec.startup["drafter"].startswith("auto: lookup alone, switched" if accepted < 0.5 else "auto: the target's")


def test_a_fixed_k_prices_the_copy_at_the_width_it_verifies():
    """Under -k auto the copy's estimate is its best width's; a fixed k verifies k + 1 tokens every
    step, so its estimate is that width's alone, even where another would pay (and that one does not)."""
    verify, draft = (0.04, 0.044, 0.048, 0.052, 0.056, 0.16), 0.004
    best, q = drafter.copy_gain(drafter.Costs(verify, draft))
    assert q == 5 and best > drafter.LOOKUP_GAIN
    assert drafter.copy_gain(drafter.Costs(verify, draft, fixed=5)) == (best, 5)
    wide, q = drafter.copy_gain(drafter.Costs(verify, draft, fixed=6))  # a verify of 6 costs 4 plain steps
    assert q == 6 and wide < drafter.LOOKUP_GAIN < best
    assert drafter.decide(drafter.Costs(verify, draft, fixed=6))[0] == "ngram"
    assert drafter.decide(drafter.Costs(verify, draft, fixed=5))[0] == "draft"


def test_a_copy_the_policy_hardly_drafts_with_is_idle():
    assert drafter.idle({0: drafter.REVISE_AFTER - 1}) is None  # too few row-steps to say
    assert drafter.idle({0: 90, 2: 10}) is not None  # drafted in a tenth: the policy's exploring
    assert drafter.idle({0: 80, 3: 20}) is None
    assert drafter.idle({0: 200}).startswith("auto: lookup alone, switched from the copy after -k auto drafted")


@pytest.mark.parametrize("drafts", [False, True])
def test_a_decoder_switches_to_lookup_when_the_policy_never_drafts_with_the_copy(monkeypatch, drafts):
    """A run in which -k auto drafted with the copy in no row-step (its plan patched to 0) learns no
    acceptance, and the next run uses lookup alone, saying why; one that drafted keeps the copy.
    Every run is exact."""
    from batchspec.policy.speculation import Adaptive

    monkeypatch.setattr(Adaptive, "plan", lambda self, batch: 2 if drafts else 0)
    monkeypatch.setattr(Adaptive, "stop_rule", lambda self, batch, started: None)
    monkeypatch.setattr(Adaptive, "choose", lambda self, batch, proposal, started: proposal.drafts.shape[1])
    monkeypatch.setattr(Adaptive, "acceptance", lambda self: (0.0, 0.0))  # revise has nothing to go on
    dec = _two_runs_with_the_copy(monkeypatch, random_prompts(8, 4, 4, 30), 24)
    assert dec.ran == ["draft", "draft" if drafts else "ngram"]
    if drafts:
        assert dec.startup["drafter"].startswith("auto: the target's own copy")
    else:
        assert sum(dec.stats.chosen_k.values()) >= drafter.REVISE_AFTER
        assert "switched from the copy after -k auto drafted with it in 0 of" in dec.startup["drafter"]


def test_the_policy_reports_the_acceptance_it_learned(tiny64):
    from batchspec.policy.speculation import Adaptive, Fixed

    policy = Adaptive(tiny64.target, types.SimpleNamespace(model=None, bins=2, branches=1, kv_from_target=False), 4)
    assert policy.acceptance() == (0.0, 0.0) and Fixed(3).acceptance() == (0.0, 0.0)
    policy.seen[1, 0], policy.hits[1, 0], policy.seen[0, 1], policy.hits[0, 1] = 6.0, 3.0, 2.0, 1.0
    assert policy.acceptance() == (8.0, 0.5)


@pytest.mark.parametrize("copy_pays", [True, False])
def test_a_server_runs_what_the_measured_costs_choose(monkeypatch, copy_pays):
    """`batchspec serve --target T` builds its engine with the proposer the costs choose, and its
    start-up report says which (a server keeps its first choice)."""
    from batchspec.models.pair import PairSpec
    from batchspec.serving import server
    from batchspec.serving.config import ServeConfig

    _user_target(monkeypatch)
    monkeypatch.setattr(drafter, "measure", lambda *a: _fake_costs(copy_pays))
    service = server.build_service(ServeConfig(models=PairSpec(target="user-model", draft="auto")))
    try:
        proposer = service.engine.ctx.proposer
        assert (proposer.model is service.pair.draft) == copy_pays and (proposer.model is None) != copy_pays
        assert service.startup["drafter"].startswith("auto: the target's own copy" if copy_pays else "auto: lookup")
    finally:
        service.engine.shutdown()


@pytest.mark.parametrize("asked", ["draft", "ngram", "ngram+draft"])
def test_an_explicit_proposer_is_never_overridden_by_the_choice(monkeypatch, asked):
    _user_target(monkeypatch)
    pair = load_pair(target="user-model", draft="auto", dtype="float32")
    monkeypatch.setattr(drafter, "measure", lambda *a: pytest.fail("an explicit --proposer needs no choice"))
    dec = SpecDecoder(pair, method="ragged", batch_size=2, k="auto", proposer=asked)
    assert dec.proposer_name == asked and dec.startup["drafter"].startswith(f"auto: --proposer {asked} as asked")
    prompts = random_prompts(5, 2, 4, 20)
    got = dec.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [o.token_ids for o in got] == reference_tokens(pair, prompts, 16)


@pytest.mark.parametrize("why", ["memory", "device"])
def test_auto_falls_back_to_lookup_and_says_why(monkeypatch, why):
    pair_module = _user_target(monkeypatch)
    if why == "memory":
        monkeypatch.setattr(pair_module, "AUTO_MEMORY_SHARE", 1e-9)
        # the reason names the memory available: the same reading for both loads below
        monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 * 2**30))
    target = pair_module.tiny_pair().target
    reason = pair_module.auto_refusal(target, "cuda" if why == "device" else "cpu", 1)
    assert reason.startswith("auto: lookup alone") and {"memory": "MiB", "device": "cuda"}[why] in reason
    if why != "device":  # no GPU here to load onto
        pair = load_pair(target="user-model", draft="auto")
        assert pair.draft is None and pair.default_proposer == "ngram" and pair.startup["drafter"] == reason
        assert not pair.draft_candidate
        with pytest.raises(BatchspecError, match="--draft-vocab needs a draft model, and auto: lookup alone"):
            load_pair(target="user-model", draft="auto", draft_vocab=64)


def test_the_command_line_asks_for_auto_beside_a_target_unless_the_proposer_needs_no_model():
    from batchspec.cli import build_parser, pair_spec

    parse = build_parser().parse_args
    assert pair_spec(parse(["generate", "--target", "m", "hi"])).draft == "auto"
    assert pair_spec(parse(["generate", "--target", "m", "--proposer", "draft", "hi"])).draft == "auto"
    assert pair_spec(parse(["generate", "--target", "m", "--proposer", "ngram", "hi"])).draft is None
    assert pair_spec(parse(["generate", "--target", "m", "--draft", "d", "hi"])).draft == "d"
    assert pair_spec(parse(["generate", "hi"])).draft is None
    with pytest.raises(BatchspecError, match="--draft auto chooses a drafter beside --target"):
        load_pair("tiny", draft="auto")


def _user_pair(monkeypatch, **kw):
    """A user's --target T --draft D, as `_load_spec_pair` returns it (the tiny pair, its draft as
    theirs), loaded with the target's own copy beside it where memory allows; eager, for speed (a
    user's draft compiled: tests/test_compiled.py)."""
    from batchspec.models import pair as pair_module

    def load(target, draft, dtype, tp_size=1):
        assert draft == "user-draft"
        made = pair_module.tiny_pair(dtype=dtype)
        made.head = None
        return made

    monkeypatch.setattr(pair_module, "_load_spec_pair", load)
    return load_pair(target="user-model", draft="user-draft", dtype="float32", compile=False, **kw)


def _costs_by_model(pair, yours: float, copy: float, int4: float = 0.04):
    """A fake `drafter.measure`: a plain step of 40 ms, verifies 10% dearer a token, and a forward
    of `yours`, `copy` or `int4` seconds as the draft measured is the user's, the target's copy or
    the user's in int4."""
    forward = {id(pair.draft): yours, id(pair.copy[0]): copy, id(pair.draft_int4[0]): int4}
    verify = tuple(0.04 * (1 + 0.1 * j) for j in range(6))
    return lambda config, target, draft: drafter.Costs(verify, forward[id(draft)])


@pytest.mark.parametrize(
    ("yours", "copy", "int4", "want"),
    [
        (0.002, 0.02, 0.04, "yours"),
        (0.04, 0.004, 0.04, "copy"),
        (0.04, 0.04, 0.001, "int4"),
        (0.04, 0.04, 0.04, "lookup"),
    ],
)
def test_a_users_draft_runs_beside_the_copies_and_lookup_as_the_measured_costs_choose(
    monkeypatch, yours, copy, int4, want
):
    """`--target T --draft D`: the target's own int4 copy and D's are built beside their draft, and
    the cheapest model to draft with runs (or lookup alone, where none pays), named in the start-up
    report; every choice is exact against `reference`."""
    pair = _user_pair(monkeypatch)
    assert pair.draft_candidate and pair.copy is not None and pair.draft_int4 is not None
    assert pair.startup["drafter"].startswith("auto: your draft model, lookup, your draft in int4, the target's")
    for model in (pair.copy[0], pair.draft_int4[0]):
        assert {m.kind for m in model.modules() if isinstance(m, QuantLinear)} >= {"int4"}
    assert pair.describe()["copy"]["bytes"] < pair.describe()["target"]["bytes"]
    assert pair.describe()["draft_int4"]["bytes"] < pair.describe()["draft"]["bytes"]
    monkeypatch.setattr(drafter, "measure", _costs_by_model(pair, yours, copy, int4))
    dec = SpecDecoder(pair, method="ragged", batch_size=3, k="auto")
    model = {"yours": pair.draft, "copy": pair.copy[0], "int4": pair.draft_int4[0], "lookup": None}[want]
    assert dec.proposer_name == ("ngram" if want == "lookup" else "draft")
    assert getattr(dec.proposer, "model", None) is model
    assert dec.proposer.kv_from_target == (want == "copy")
    label = {
        "yours": "auto: your draft model (",
        "copy": "auto: the target's own copy (",
        "int4": "auto: your draft model in int4 (",
        "lookup": "auto: lookup",
    }
    assert dec.startup["drafter"].startswith(label[want]) and "accepting" in dec.startup["drafter"]
    prompts = random_prompts(9, 3, 4, 30)
    got = dec.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [o.token_ids for o in got] == reference_tokens(pair, prompts, 20)


def test_an_explicit_proposer_runs_the_users_draft(monkeypatch):
    pair = _user_pair(monkeypatch)
    monkeypatch.setattr(drafter, "measure", lambda *a: pytest.fail("an explicit --proposer needs no choice"))
    dec = SpecDecoder(pair, method="ragged", batch_size=2, k="auto", proposer="draft")
    assert dec.proposer.model is pair.draft and "as asked (beside your draft model)" in dec.startup["drafter"]


def test_without_memory_for_the_copy_the_users_draft_is_weighed_against_lookup(monkeypatch):
    from batchspec.models import pair as pair_module

    monkeypatch.setattr(pair_module, "AUTO_MEMORY_SHARE", 1e-9)
    pair = _user_pair(monkeypatch)
    assert pair.copy is None and pair.draft_int4 is None and pair.draft_candidate
    assert "MiB" in pair.startup["drafter"] and "not your draft in int4 (it needs ~" in pair.startup["drafter"]
    monkeypatch.setattr(drafter, "measure", lambda *a: drafter.Costs((0.04, 0.044, 0.048), 0.002))
    dec = SpecDecoder(pair, method="ragged", batch_size=2, k="auto")
    assert dec.proposer.model is pair.draft and dec.startup["drafter"].startswith("auto: your draft model")


def test_the_users_draft_in_int4_is_built_only_where_it_is_another_model_and_memory_is_left(monkeypatch):
    """D's int4 copy needs memory left after the target's copy, and is not built where D holds the
    target's own weights (the target's copy is that model)."""
    from batchspec.models import pair as pair_module

    pair = pair_module.tiny_pair()
    copy_bytes = pair_module.int4_bytes(pair.target)
    budget = pair_module._Budget(10**9, copy_bytes + 0.5 * pair_module.int4_bytes(pair.draft))
    monkeypatch.setattr(pair_module, "_memory_budget", lambda: budget)
    pair_module._add_candidates(pair, "cpu", 1)
    assert pair.copy is not None and pair.draft_int4 is None
    assert "not your draft in int4 (it needs ~" in pair.drafter
    same = pair_module.tiny_pair()
    same.target.batchspec_source = same.draft.batchspec_source = "file-digest"
    monkeypatch.setattr(pair_module, "_memory_budget", lambda: pair_module._Budget(10**12, 10**12))
    pair_module._add_candidates(same, "cpu", 1)
    assert same.copy is not None and same.draft_int4 is None and "the same weights as the target" in same.drafter
    pair_module._add_candidates(other := pair_module.tiny_pair(), "cpu", 1)
    assert other.draft_int4 is not None and other.draft_int4[0] is not other.draft


def test_the_users_draft_in_int4_is_estimated_from_its_own_agreement(monkeypatch):
    """Measured as their draft's is, where its scores are the target's tokens'; else their draft's
    estimate scaled by what int4 kept of the target's agreement."""
    pair = _user_pair(monkeypatch)
    view = pair.with_draft_int4()
    assert view.draft is pair.draft_int4[0] and view.copy is None and not view.draft_copies_target
    agreed = drafter.agreement(view)
    assert drafter.estimated_accept(view, pair) == pytest.approx(agreed * drafter.COPY_ACCEPT / drafter.COPY_AGREEMENT)
    reduced = types.SimpleNamespace(draft=torch.nn.Linear(2, 2), draft_vocab_ids=torch.arange(8), tokenizer=None)
    want = drafter.estimated_accept(pair) * drafter.COPY_AGREEMENT
    assert drafter.estimated_accept(reduced, pair) == pytest.approx(want)


def test_a_draft_quantized_as_asked_is_no_candidate(monkeypatch):
    pair = _user_pair(monkeypatch, draft_quant="int8")
    assert pair.copy is None and pair.draft_int4 is None and not pair.draft_candidate
    assert SpecDecoder(pair, method="ragged", batch_size=2, k="auto").proposer.model is pair.draft


def test_a_users_drafts_acceptance_is_estimated_from_its_agreement_with_the_target(monkeypatch):
    """Teacher-forced on a built-in text: the target as its own draft agrees everywhere, the tiny
    pair's noisy draft less; the estimate is the agreement scaled as the copy's was."""
    pair = _user_pair(monkeypatch)
    agreed = drafter.agreement(pair)
    assert 0.0 < agreed < 1.0
    assert drafter.estimated_accept(pair) == pytest.approx(agreed * drafter.COPY_ACCEPT / drafter.COPY_AGREEMENT)
    same = types.SimpleNamespace(tokenizer=pair.tokenizer, draft_vocab_ids=None, device=pair.device)
    same.target = same.draft = pair.target
    assert drafter.agreement(same) == 1.0
    same.draft_vocab_ids = torch.arange(8)  # a reduced head: its scores are not the target's tokens'
    assert drafter.agreement(same) is None


def test_the_users_drafts_measured_acceptance_revises_the_choice():
    costs = _fake_costs(copy_pays=True)
    why = drafter.revise(costs, 500, 0.3, drafter.YOURS)
    assert why.startswith("auto: lookup alone, switched from your draft after 500 drafts accepted at 0.30")


def test_a_users_draft_accepted_too_rarely_yields_to_the_copy():
    costs = _fake_costs(copy_pays=True)
    rival = drafter.Choice("draft", "", costs, drafter.COPY, gain=1.5)
    why = drafter.revise(costs, 500, 0.3, drafter.YOURS, rival)
    assert why.startswith("auto: the target's own copy, switched from your draft after 500 drafts accepted at 0.30")
    assert "the copy 1.50x" in why and drafter.revise(costs, 500, 0.95, drafter.YOURS, rival) is None


def test_a_decoder_switches_from_the_users_draft_to_the_copy_after_a_run(monkeypatch):
    """Their draft chosen first (its forward cheapest), the copy next best: a run whose drafts were
    accepted at 0.3 hands the next run to the copy, which starts from the target's cache; both runs
    exact."""
    from batchspec.policy.speculation import Adaptive

    pair = _user_pair(monkeypatch)
    monkeypatch.setattr(drafter, "measure", _costs_by_model(pair, 0.002, 0.004))
    monkeypatch.setattr(drafter, "estimated_accept", lambda pair, full=None: drafter.COPY_ACCEPT)  # as the copy's
    monkeypatch.setattr(Adaptive, "acceptance", lambda self: (200.0, 0.3))
    dec = SpecDecoder(pair, method="ragged", batch_size=3, k="auto")
    prompts = random_prompts(10, 3, 4, 30)
    ran = []
    for _ in range(2):
        ran.append((dec.proposer.model, dec.proposer.kv_from_target, dec.startup["drafter"]))
        got = dec.generate(prompts, SamplingParams(max_new_tokens=16))
        assert [o.token_ids for o in got] == reference_tokens(pair, prompts, 16)
    assert [r[:2] for r in ran] == [(pair.draft, False), (pair.copy[0], True)]
    assert ran[1][2].startswith("auto: the target's own copy, switched from your draft")
    assert dec.proposer_name == "ngram"  # and the copy, accepted as rarely, yields to lookup


def test_under_tensor_parallelism_a_users_draft_runs_as_given():
    """Every rank must run the same proposer, and each would time its own candidates: under --tp
    their draft is no candidate and no copy is built."""
    from batchspec.models import pair as pair_module

    pair = pair_module.tiny_pair()
    pair_module._add_candidates(pair, "cpu", 2)
    assert pair.copy is None and not pair.draft_candidate and not pair.drafter
    pair_module._add_candidates(pair, "cpu", 1)
    assert pair.copy is not None and pair.draft_candidate
