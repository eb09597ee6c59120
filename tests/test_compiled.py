"""The compiled decoder (models/compiled.py): the same tokens as the reference through every method
on a compiled target, the same logits and features as the eager layers, and the forwards it does
not serve (many tokens, the batch-invariant mode, layers it cannot compute) run eager, said so."""

from __future__ import annotations

import copy
import json
import random
import warnings
from unittest import mock

import pytest
import torch
from helpers import decode, random_prompts, reference_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.cli import main
from batchspec.core.errors import BatchspecError
from batchspec.core.stats import startup_text
from batchspec.engine import admission
from batchspec.engine.admission import Admission
from batchspec.models import compiled, lean, precompiled
from batchspec.models import pair as pair_module
from batchspec.models.forward import decoder_features
from batchspec.policy import speculation


@pytest.fixture(scope="module")
def compiled64():
    pair = load_pair("tiny", dtype="float64", compile=True)
    assert pair.startup["forward"] == "compiled" and pair.startup["compile_s"] > 0
    return pair


def _graph_calls(pair) -> int:
    return compiled.compiled(pair.target).calls


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 12),
    batch=st.integers(1, 8),
    k=st.integers(1, 6),
    method=st.sampled_from(["ar", "spec1", "eqspec", "exspec", "ragged"]),
    proposer=st.sampled_from(["draft", "ngram", "eagle"]),
)
def test_every_method_on_a_compiled_target_equals_the_reference(compiled64, seed, n, batch, k, method, proposer):
    prompts = random_prompts(seed, n, 1, 40)
    before = _graph_calls(compiled64)
    got = decode(compiled64, prompts, 16, method=method, batch_size=batch, k=k, proposer=proposer)
    assert got == reference_tokens(compiled64, prompts, 16)
    assert _graph_calls(compiled64) > before  # the graph served the steps


def test_k_auto_and_trees_on_a_compiled_target(compiled64):
    prompts = random_prompts(7, 6, 1, 60)
    for config in ({"k": "auto"}, {"k": 3, "branches": 2, "proposer": "eagle"}):
        got = decode(compiled64, prompts, 20, method="ragged", batch_size=4, **config)
        assert got == reference_tokens(compiled64, prompts, 20), config


@torch.inference_mode()
def test_compiled_logits_and_features_equal_the_eager_layers(compiled64):
    target = compiled64.target
    eager = copy.deepcopy(target)
    decoder = eager.get_decoder()
    decoder.forward = decoder.batchspec_compiled.eager  # the same lean layers, op by op
    del decoder.batchspec_compiled
    ids = torch.randint(0, 256, (3, 9))
    caches = [DynamicCache(config=target.config) for _ in range(2)]
    for lo, hi in ((0, 5), (5, 6), (6, 9)):  # a prompt, one token, three: both graphs
        feed = ids[:, lo:hi]
        got, want = (m(input_ids=feed, cache=c, use_cache=True).logits for m, c in zip((target, eager), caches))
        # transformers' final norm computes in float32 (a float64 model's logits round there)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    aux = (0, 1)
    got = decoder_features(target, aux, input_ids=ids)[1]
    want = decoder_features(eager, aux, input_ids=ids)[1]
    width = target.config.hidden_size
    assert got.shape == want.shape == (3, 9, 3 * width)
    torch.testing.assert_close(got[..., width:], want[..., width:], atol=1e-12, rtol=1e-12)  # the layers: float64
    torch.testing.assert_close(got[..., :width], want[..., :width], atol=1e-5, rtol=1e-5)


def test_long_prompts_and_the_invariant_mode_run_eager_and_exact():
    pair = load_pair("tiny", dtype="float32", compile=True)
    graph = compiled.compiled(pair.target)
    long = random_prompts(3, 1, compiled.MAX_ROWS + 10, compiled.MAX_ROWS + 20)
    calls = graph.calls
    with torch.inference_mode():
        pair.target(input_ids=torch.tensor(long))
    assert graph.calls == calls  # more than MAX_ROWS tokens: eager
    prompts = random_prompts(4, 4, 1, 30)
    dec = SpecDecoder(pair, method="ragged", batch_size=4, k=2, batch_invariant=True)
    calls = graph.calls
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=12))]
    assert graph.calls == calls  # the mode's own attention and rotary tables: eager
    SpecDecoder(pair, batch_invariant=False).generate(prompts[:1], SamplingParams(max_new_tokens=2))
    assert graph.calls > calls  # out of the mode: compiled again
    oracle = SpecDecoder(pair, method="reference", batch_invariant=True)
    assert got == [o.token_ids for o in oracle.generate(prompts, SamplingParams(max_new_tokens=12))]


def test_layers_the_lean_form_cannot_compute_stay_eager_with_the_reason(monkeypatch):
    monkeypatch.setattr(lean, "supported", lambda layer: False)  # as for a form it does not know
    with pytest.warns(UserWarning, match="running the target eager: its Gemma3DecoderLayer layers"):
        pair = load_pair("tiny-sliding", dtype="float32", compile=True)
    assert pair.startup["forward"].startswith("eager (its Gemma3DecoderLayer layers")
    assert compiled.compiled(pair.target) is None
    assert not any(isinstance(layer, lean.LeanLayer) for layer in pair.target.get_decoder().layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not asked for: no warning, and the reason it was not
        monkeypatch.delenv("BATCHSPEC_COMPILE", raising=False)
        assert load_pair("tiny-sliding").startup["forward"] == "eager (the tiny pairs run eager unless asked)"
        monkeypatch.setenv("BATCHSPEC_COMPILE", "off")
        assert load_pair("tiny").startup["forward"] == "eager (BATCHSPEC_COMPILE=off)"
        assert load_pair("tiny", compile=False).startup["forward"] == "eager (--no-compile)"


def test_the_stats_line_says_which_forward_ran(capsys):
    assert main(["generate", "--pair", "tiny", "--max-new-tokens", "4", "--no-compile", "hello"]) == 0
    assert "forward eager (--no-compile)" in capsys.readouterr().out


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_self_draft_is_compiled_with_its_quantized_products_traced(quant):
    """The target's own quantized copy runs a compiled graph too (its weight-only products are
    PyTorch kernels, traced into it); drafting through it leaves the output the reference's."""
    pair = load_pair("tiny", dtype="float32", draft="self", draft_quant=quant, compile=True)
    draft = compiled.compiled(pair.draft)
    assert draft is not None and compiled.compiled(pair.target) is not None
    prompts = random_prompts(11, 3, 2, 30)
    calls = draft.calls
    dec = SpecDecoder(pair, method="ragged", batch_size=3, k=3, proposer="draft")
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=16))]
    assert draft.calls > calls and dec.stats.summary()["mean_accepted"] > 0.5
    assert got == reference_tokens(pair, prompts, 16)
    ids = torch.tensor(random_prompts(12, 1, 40, 40))  # more than DENSE_ROWS tokens: the kernel, in the same graph
    with torch.inference_mode():
        calls, many = draft.calls, pair.draft(input_ids=ids).logits
        eager = (
            pair.draft.get_decoder().batchspec_compiled.eager(input_ids=ids).last_hidden_state
        )  # the dequantized product
        logits = pair.draft.lm_head(eager)
    assert draft.calls == calls + 1 and {key[0] for key in draft.graphs} == {None}  # one product form
    # bfloat16: the kernel's sums beside the dense product's, the same weights
    assert (many - logits).abs().max() < 0.1 * logits.abs().max()


def test_a_compiled_graph_is_kept_on_disk_and_a_later_start_loads_it(tmp_path, monkeypatch):
    """The first load compiles each graph ahead and saves it (precompiled.py); a later load of the
    same model reads them without tracing and decodes the reference's tokens; a saved graph that
    does not load is compiled again, with a warning."""
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    first = load_pair("tiny", dtype="float32", compile=True)
    graphs = compiled.compiled(first.target).graphs
    assert len(graphs) == 2 and not any(g.loaded for g in graphs.values())  # one token; two and more
    saved = sorted((tmp_path / "graphs").glob("*.bin"))
    assert len(saved) == 2
    again = load_pair("tiny", dtype="float32", compile=True)
    assert all(g.loaded for g in compiled.compiled(again.target).graphs.values())
    ids = torch.tensor([[5, 6, 7]])  # made outside inference mode: its dispatch keys differ from the guards'
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")  # no guard failure, no tracing again
        again.target(input_ids=ids)
    prompts = random_prompts(21, 5, 1, 30)
    assert decode(again, prompts, 12, method="ragged", batch_size=3, k=2) == reference_tokens(again, prompts, 12)
    for path in saved:  # the key line kept, the graph garbled
        head = path.read_bytes().split(b"\n", 1)[0]
        path.write_bytes(head + b"\nnot a graph")
    with pytest.warns(UserWarning, match="saved compiled graph that does not load"):
        third = load_pair("tiny", dtype="float32", compile=True)
    assert not any(g.loaded for g in compiled.compiled(third.target).graphs.values())
    assert decode(third, prompts, 12, method="ragged", batch_size=3, k=2) == reference_tokens(third, prompts, 12)


def test_the_cpus_vector_isas_are_checked_once_per_machine(tmp_path, monkeypatch):
    """inductor's check of the vector ISAs (a library loaded in a child process per ISA) runs on a
    first start; a later one trusts the verdict kept in the tuning cache, where every ISA passed."""
    from torch._inductor import config

    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    # config.patch, not monkeypatch: monkeypatch's undo of an inductor setting can leave it hidden
    # ("does not exist") for the rest of the process
    with config.patch({"cpp.vec_isa_ok": None}):
        precompiled.trust_vector_isas()
        assert config.cpp.vec_isa_ok is None  # checked, not trusted
        (record,) = (tmp_path / precompiled.ISA_KIND).glob("*.json")
        verdict = json.loads(record.read_text())["value"]
        precompiled.trust_vector_isas()
        assert config.cpp.vec_isa_ok is (True if verdict else None)
        config.cpp.vec_isa_ok = False  # the user's choice stands
        precompiled.trust_vector_isas()
        assert config.cpp.vec_isa_ok is False


def test_a_prompts_chunks_ride_in_the_steps_forward_and_decode_as_the_reference(compiled64):
    """Prompts admitted in chunks while rows run: each chunk's target tokens are computed in the
    step's own forward (admission's rider, models/forward.py), with -k auto, fixed k and a draft
    model fed its chunks alone, and the head's features kept; a prompt's last chunk rides too, its
    first token picked from the step's hidden state; a draft tree's verify does not carry one (fed
    alone after the step). The caches (invariant checker) and the output are the reference's."""
    prompts = random_prompts(31, 6, 40, 90)
    lengths = [6, 14, 9, 20, 11, 16]  # rows finish apart: prompts wait while others run
    want = [reference_tokens(compiled64, [p], n)[0] for p, n in zip(prompts, lengths)]
    configs = (
        {"k": "auto"},
        {"k": 3, "proposer": "eagle"},
        {"k": 3, "proposer": "draft"},
        {"k": 2, "branches": 2, "proposer": "eagle"},
    )
    for config in configs:
        dec = SpecDecoder(compiled64, method="ragged", batch_size=2, prefill_chunk=16, check_invariants=True, **config)
        got = [o.token_ids for o in dec.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])]
        assert got == want, config
        carried, chunks = dec.stats.extra["prefill_chunks_carried"], dec.stats.extra["prefill_chunks"]
        assert chunks > 0 and carried == (0 if "branches" in config else chunks), config
        ends = dec.stats.extra["prefill_ends_carried"]  # a last chunk's first token from the step's forward
        assert ends == 0 if "branches" in config else ends > 0, config


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(2, 4),
    k=st.sampled_from([2, "auto"]),
    proposer=st.sampled_from(["eagle", "draft", "ngram"]),
)
def test_prompts_admitted_while_rows_run_ride_whole_and_equal_the_reference(compiled64, seed, batch, k, proposer):
    """More prompts than rows, no fixed chunk, `ride_prompts` on: a prompt admitted while rows run rides the step's
    forward whole, its first token picked from the step's hidden state after it, greedy, seeded and
    under a grammar alike; every output is the reference's (grammar masks and seeds included)."""
    rng = random.Random(seed)
    prompts = random_prompts(seed, 7, 5, 60)
    params = []
    for i in range(len(prompts)):
        extra = rng.choice([{}, {"temperature": 0.9, "seed": seed + i}, {"regex": "[a-f0-9]{3,20}"}])
        params.append(SamplingParams(max_new_tokens=rng.randint(3, 14), **extra))
    want = [o.token_ids for o in SpecDecoder(compiled64, method="reference").generate(prompts, params)]
    dec = SpecDecoder(compiled64, method="ragged", batch_size=batch, k=k, proposer=proposer, check_invariants=True)
    with mock.patch.object(Admission, "ride_prompts", True):
        assert [o.token_ids for o in dec.generate(prompts, params)] == want


def test_a_prompt_admitted_while_rows_run_rides_whole(compiled64, monkeypatch):
    """Three rows, eight prompts finishing apart: the prompts admitted after the first wave ride
    (none is chunked), and the output is the reference's. The policy times a step that carried
    one less its estimated share once admission's fit is trusted, else not at all (None); every
    other step with its positive seconds."""
    monkeypatch.setattr(Admission, "ride_prompts", True)
    monkeypatch.setattr(admission, "FIT_RIDES", 1)  # the riding fit trusted after one rider
    timed = []
    observe = speculation.Adaptive.observe
    monkeypatch.setattr(speculation.Adaptive, "observe", lambda self, *a: (timed.append(a[5]), observe(self, *a))[1])
    ridden = []  # admission times every step, with the rider tokens it carried
    observe_step = Admission.observe_step

    def observe_step_fixed(self, seconds, n=0):  # timed, then a riding fit fixed at 1 ns a token
        ridden.append(n)
        observe_step(self, seconds, n)
        self.riding.a, self.riding.b = 0.0, 1e-9

    monkeypatch.setattr(Admission, "observe_step", observe_step_fixed)
    prompts = random_prompts(31, 8, 40, 90)
    lengths = [6, 14, 9, 20, 11, 16, 7, 12]
    want = [reference_tokens(compiled64, [p], n)[0] for p, n in zip(prompts, lengths)]
    dec = SpecDecoder(compiled64, method="ragged", batch_size=3, k="auto", check_invariants=True)
    assert [o.token_ids for o in dec.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])] == want
    extra = dec.stats.extra
    assert extra["prefill_chunks"] == 0 and extra["prefill_ends_carried"] >= 4
    assert all(t is None or t > 0 for t in timed) and len(ridden) == len(timed)
    assert all(n > 0 for n, t in zip(ridden, timed) if t is None)  # only a riding step goes untimed
    estimated = sum(1 for n in ridden if n) - timed.count(None)  # riders timed less their share
    assert timed.count(None) == 1  # the first rider: no fit to estimate its share yet
    assert estimated + 1 == extra["prefill_ends_carried"]


def test_max_autotune_tunes_packages_once_per_weights_and_decodes_as_the_reference(monkeypatch, capsys, tmp_path):
    """A first --max-autotune start freezes the weights into inductor's tuned GEMM kernels and
    compiles each frozen graph into a package kept in the tuning cache; a later start of the same
    weights loads the packages without tracing anything; a package cut short is made again; a
    model of the same shapes but other weights finds none of them (a package holds its weights'
    packed copies, so a key of shapes alone would serve it stale ones). Every start computes what
    the eager model computes and decodes as the reference; a prompt past the frozen graphs' tokens
    is prefilled eager; weights changed in place after freezing are refused."""
    from torch._dynamo.utils import counters

    from batchspec import tiny_pair

    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))  # an empty tuning cache of its own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # read by inductor at each use
    monkeypatch.setenv(compiled.ENV, "max-autotune")  # as load_pair(compile="max-autotune") or --max-autotune
    # the CPP kernels alone here, so a CPU where ATen's time faster does not choose them away
    monkeypatch.setattr(compiled, "AUTOTUNE", compiled.AUTOTUNE | {"max_autotune_gemm_backends": "CPP"})
    ids = torch.tensor([[5, 17, 260, 3, 99, 42]])
    eager = tiny_pair().target

    def start():
        counters.clear()
        pair = load_pair("tiny", dtype="float32")
        assert pair.startup["forward"] == "compiled (max-autotune)"
        with torch.inference_mode():  # the wider graph, then the one-token graph
            for x in (ids, ids[:, :1]):
                want = eager(input_ids=x).logits
                torch.testing.assert_close(pair.target(input_ids=x, use_cache=True).logits, want, rtol=1e-4, atol=1e-4)
        sources = [p.source for p in compiled.compiled(pair.target).packages]
        notice = "compiling the target for --max-autotune" in capsys.readouterr().err  # minutes: said first
        assert notice == (sources == ["made", "made"])  # (a package there but broken: made again, unsaid)
        return pair, dict(counters["inductor"]), dict(counters["stats"]), sources

    def kept() -> set[str]:
        return {p.name for p in (tmp_path / "cache" / "packages").iterdir() if not p.name.startswith(".")}

    pair, first, _, sources = start()  # exported, compiled, tuned and packaged
    # the products are inductor's own GEMM kernels (which need the weights frozen: with them as
    # inputs the graph called ATen's mm)
    assert first.get("cpp_templated_kernel_counter", 0) > 0 and sources == ["made", "made"]
    made = kept()
    assert len(made) == 2  # the one-token graph's and the other's
    prompts = random_prompts(3, 5, 1, 30)
    for method, k in (("ar", 1), ("ragged", 3), ("exspec", 2)):
        before = _graph_calls(pair)
        got = decode(pair, prompts, 12, method=method, batch_size=3, k=k, proposer="draft")
        assert got == reference_tokens(pair, prompts, 12), method
        assert _graph_calls(pair) > before
    long = random_prompts(4, 1, compiled.FROZEN_MAX_ROWS + 1, compiled.FROZEN_MAX_ROWS + 9)
    want, before = reference_tokens(pair, long, 3), _graph_calls(pair)
    assert decode(pair, long, 3, method="ar", batch_size=1) == want
    assert _graph_calls(pair) == before + 2  # two steps; the prefill, past the frozen graphs' tokens, eager

    pair, _, traced, sources = start()  # a later start: loaded, nothing traced
    assert sources == ["loaded", "loaded"] and traced.get("unique_graphs", 0) == 0
    want = reference_tokens(pair, prompts, 12)
    assert decode(pair, prompts, 12, method="ragged", batch_size=3, k=3, proposer="draft") == want
    monkeypatch.delenv(compiled.ENV)  # a default start, the tiny pair compiled as a real one is: the packages, loaded
    monkeypatch.setattr(pair_module, "default_eager_reason", lambda pair: None)
    auto = load_pair("tiny", dtype="float32")
    assert auto.startup["forward"] == "compiled (max-autotune, tuned packages from the cache)"
    assert "s (max-autotune, tuned packages from the cache)" in startup_text(auto.startup)  # the stats line
    assert decode(auto, prompts, 12, method="ragged", batch_size=3, k=3, proposer="draft") == want
    assert [p.source for p in compiled.compiled(auto.target).packages] == ["loaded", "loaded"]
    with torch.inference_mode():  # a caller loading in inference mode: weights whose versions are not tracked
        assert load_pair("tiny", dtype="float32").startup["forward"] == auto.startup["forward"]
    with monkeypatch.context() as m:  # packed copies past the memory budget: the default graph, unasked
        m.setattr(pair_module, "_memory_budget", lambda: pair_module._Budget(2**20, 2**18))
        assert load_pair("tiny", dtype="float32").startup["forward"] == "compiled"
        assert load_pair("tiny", dtype="float32", compile="tune").startup["forward"] == "compiled"
        assert "not compiling the target for --max-autotune: its packed weights need" in capsys.readouterr().err
    monkeypatch.setenv(compiled.ENV, "graph")  # the default graph, packages or not
    assert load_pair("tiny", dtype="float32").startup["forward"] == "compiled"
    monkeypatch.setenv(compiled.ENV, "max-autotune")
    broken = tmp_path / "cache" / "packages" / sorted(made)[0] / "graph.pt2"
    broken.write_bytes(broken.read_bytes()[:1000])  # a package cut short: made again, with a warning
    pair, _, _, sources = start()
    assert sorted(sources) == ["loaded", "made"] and kept() == made
    other = tiny_pair(seed=12).target  # other weights of the same shapes: none of the packages is theirs
    lean.install(other)
    compiled.install(other, autotune=True)
    assert not compiled.compiled(other).packaged() and compiled.compiled(pair.target).packaged()
    assert compiled.tuned_cached(pair.target) and not compiled.tuned_cached(other)
    with torch.no_grad():
        pair.target.get_decoder().layers[0].qkv.weight.mul_(2)  # the graph holds the weights as they were
    with pytest.raises(BatchspecError, match="changed in place after --max-autotune froze them"):
        decode(pair, prompts[:1], 4, method="ar", batch_size=1)


def test_tune_makes_the_tuned_packages_where_a_default_start_would_compile(monkeypatch):
    """`batchspec tune` asks for --max-autotune's packages (which later default starts load) unless
    a flag or $BATCHSPEC_COMPILE chose a mode; load_pair grants them only where a default start
    would compile: not for the tiny pairs (eager by default)."""
    from batchspec.cli import build_parser, tunes_kernels

    def tunes(*argv):
        return tunes_kernels(build_parser().parse_args(["tune", *argv]))

    monkeypatch.delenv(compiled.ENV, raising=False)
    assert tunes("--target", "model.gguf") and tunes("--pair", "default")
    assert not tunes("--pair", "default", "--no-compile") and not tunes("--pair", "default", "--max-autotune")
    assert load_pair("tiny", compile="tune").startup["forward"] == "eager (the tiny pairs run eager unless asked)"
    monkeypatch.setenv(compiled.ENV, "graph")
    assert not tunes("--pair", "default")


def test_an_unknown_compile_mode_is_refused_by_name():
    with pytest.raises(BatchspecError, match="unknown compile mode 'fast'"):
        load_pair("tiny", compile="fast")


def test_a_qwen3_target_is_compiled_and_every_method_equals_the_reference(tmp_path):
    """Qwen3's layers (an RMS norm over each head of q and k before RoPE) are lean and compiled: a
    pair of them from local directories (the draft compiled too) decodes as the reference through
    each layout and drafter."""
    from transformers import Qwen3Config

    from batchspec.models.tiny import byte_tokenizer, tiny_models

    config = Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        initializer_range=0.2,
        pad_token_id=256,
        bos_token_id=257,
        eos_token_id=258,
        tie_word_embeddings=False,
    )
    target, draft = tiny_models(config, noise=0.02, seed=3)
    for model, name in ((target, "target"), (draft, "draft")):
        with torch.no_grad():  # per-head norms away from ones, so a norm left out shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        model.save_pretrained(tmp_path / name)
        byte_tokenizer(320).save_pretrained(tmp_path / name)
    pair = load_pair(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), dtype="float64", compile=True)
    assert pair.startup["forward"] == "compiled"
    for model in (pair.target, pair.draft, pair.draft_int4[0]):  # the user's draft (and its int4 copy)
        assert all(isinstance(layer, lean.LeanLayer) for layer in model.get_decoder().layers)
    assert compiled.compiled(pair.draft_int4[0]) is not None
    prompts = random_prompts(11, 6, 1, 40)
    want = reference_tokens(pair, prompts, 14)
    before, drafted = _graph_calls(pair), compiled.compiled(pair.draft).calls
    for method, proposer, batch in (("ar", None, 3), ("ragged", "draft", 4), ("exspec", "ngram", 2)):
        config = {"k": 3, "proposer": proposer} if proposer else {}
        assert decode(pair, prompts, 14, method=method, batch_size=batch, **config) == want, method
    assert _graph_calls(pair) > before and compiled.compiled(pair.draft).calls > drafted


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 6),
    k=st.integers(1, 4),
    method=st.sampled_from(["ar", "eqspec", "exspec", "ragged"]),
    proposer=st.sampled_from(["draft", "ngram", "ngram+draft"]),
)
def test_a_compiled_gemma3_target_with_windows_equals_the_reference(sliding_compiled, seed, batch, k, method, proposer):
    """Gemma 3's lean layers in the graph (a RoPE table per layer kind, windows of 6 keys cut from
    the mask, each size class's keys read from the first its rows' windows see): every method
    gives the reference's tokens on prompts and outputs far longer than the window."""
    prompts = random_prompts(seed, 4, 1, 30)
    before = _graph_calls(sliding_compiled)
    got = decode(sliding_compiled, prompts, 14, method=method, batch_size=batch, k=k, proposer=proposer)
    assert got == reference_tokens(sliding_compiled, prompts, 14)
    assert _graph_calls(sliding_compiled) > before


@pytest.fixture(scope="module")
def sliding_compiled():
    pair = load_pair("tiny-sliding", dtype="float64", compile=True)
    assert pair.startup["forward"] == "compiled"
    assert all(isinstance(layer, lean.LeanLayer) for layer in pair.target.get_decoder().layers)
    return pair
