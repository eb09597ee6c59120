"""The disk cache (diskcache.py): machine measurements reused by a later start, a miss whenever
anything they depend on changes, and a cache that is corrupt, foreign, unwritable or shared by two
processes at once never stops a run. The GGUF conversion gives the GGUF's own weights and tokenizer."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from batchspec import SamplingParams, SpecDecoder
from batchspec.core import diskcache
from batchspec.models import linears
from batchspec.models import pair as models
from batchspec.models.pair import tiny_pair
from batchspec.policy import costmodel, speculation

PROMPTS = [[5, 9, 12, 7, 7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty cache directory for one test."""
    monkeypatch.setenv(diskcache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def decode(pair, **config):
    dec = SpecDecoder(pair, method="ragged", k="auto", batch_size=2, progress=False, **config)
    outs = dec.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    return [o.token_ids for o in outs], dec


def test_a_second_start_measures_nothing_and_decodes_the_same(cache):
    first, dec1 = decode(tiny_pair())
    assert dec1.startup["tuning"] == "measured"
    assert list((cache / "linear-forms").iterdir()) and list((cache / "step-probes").iterdir())
    second, dec2 = decode(tiny_pair())  # a new pair: nothing kept in memory
    assert dec2.startup["tuning"] == "cached"
    assert second == first
    assert dec2.speculation.step_cost.describe().keys() == dec1.speculation.step_cost.describe().keys()
    assert dec2.stats.summary()["startup"]["tuning"] == "cached"
    assert "tuning" in dec2.stats.line() and "(cached)" in dec2.stats.line()


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    monkeypatch.setenv(diskcache.ENV, "off")
    _, dec = decode(tiny_pair())
    assert dec.startup["tuning"] == "measured" and not cache.exists()
    _, dec = decode(tiny_pair())
    assert dec.startup["tuning"] == "measured"


def probe_record(pair) -> dict:
    return costmodel.probe_key(pair.target, 2, 3, (64, 768))


def form_record(pair) -> dict:
    return {"machine": diskcache.machine(), "model": diskcache.model_identity(pair.target)}


@pytest.mark.parametrize(
    "change",
    ["weights", "shapes", "dtype", "threads", "cpu", "torch version", "batchspec version"],
)
def test_every_key_change_is_a_miss(cache, monkeypatch, change):
    """A record made under one key is found under it, and under no key that differs in anything
    a timing depends on."""
    pair = tiny_pair()
    diskcache.write("step-probes", probe_record(pair), [[1, 1, 64, 0.5]])
    diskcache.write("linear-forms", form_record(pair), {"1": "plain"})
    assert diskcache.read("step-probes", probe_record(tiny_pair())) == [[1, 1, 64, 0.5]]
    assert diskcache.read("linear-forms", form_record(tiny_pair())) == {"1": "plain"}
    other = pair
    if change == "weights":
        other = tiny_pair(seed=1)
    elif change == "shapes":
        other = tiny_pair(hidden=32)
    elif change == "dtype":
        other = tiny_pair(dtype=torch.float64)
    elif change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    else:
        field = {"cpu": "cpu", "torch version": "torch", "batchspec version": "batchspec"}[change]
        platform = diskcache._platform()
        monkeypatch.setattr(diskcache, "_platform", lambda: platform | {field: "another"})
    assert diskcache.read("step-probes", probe_record(other)) is None
    assert diskcache.read("linear-forms", form_record(other)) is None


def test_the_proposer_is_part_of_the_key(cache):
    """A head's probes and a draft model's are kept apart (each keyed by its own model)."""
    pair = tiny_pair()
    assert diskcache.model_identity(pair.head) != diskcache.model_identity(pair.draft)
    assert costmodel.probe_key(pair.head, 2, 1, (64, 768)) != costmodel.probe_key(pair.draft, 2, 1, (64, 768))


def test_a_corrupt_or_foreign_record_is_ignored_with_a_warning(cache):
    pair = tiny_pair()
    key = probe_record(pair)
    diskcache.write("step-probes", key, [[1, 1, 64, 0.5]])
    (path,) = (cache / "step-probes").iterdir()
    path.write_text("{not json", encoding="utf-8")
    with pytest.warns(UserWarning, match="unreadable cache file"):
        assert diskcache.read("step-probes", key) is None
    path.write_text(json.dumps({"format": diskcache.FORMAT, "key": {"someone": "else"}, "value": 1}))
    assert diskcache.read("step-probes", key) is None  # a foreign record: a miss, quietly
    path.write_text(json.dumps({"format": diskcache.FORMAT, "key": key, "value": [["a", 1]]}))
    samples = costmodel.probe(pair.target, 2, 3)  # a record of the wrong shape is measured again
    assert all(isinstance(s[3], float) and s[3] > 0 for s in samples)
    assert diskcache.read("step-probes", key) == [list(s) for s in samples]


def test_an_unwritable_cache_warns_once_and_decodes(tmp_path, monkeypatch):
    """A cache path that cannot be made (beneath a file; a read-only directory fails alike for a
    user without root): the run measures without it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv(diskcache.ENV, str(blocker / "cache"))
    monkeypatch.setattr(diskcache, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, dec = decode(tiny_pair())
    said = [str(w.message) for w in caught if "cannot be written" in str(w.message)]
    assert len(said) == 1 and dec.startup["tuning"] == "measured"
    assert tokens == decode(tiny_pair())[0]


def test_a_drifted_cached_fit_is_probed_again_and_the_cache_updated(cache, monkeypatch):
    """Probes cached from a machine state 100x slower than now: the steps' load factor leaves its
    band, the costs are probed afresh once, and the record replaced."""
    monkeypatch.setattr(speculation, "DRIFT_STEPS", 8)
    pair = tiny_pair()
    key = probe_record(pair)
    stale = [[b, q, s, t * 100] for b, q, s, t in costmodel.probe(pair.target, 2, 3)]
    diskcache.write("step-probes", key, stale)
    fresh_pair = tiny_pair()
    policy = speculation.Adaptive(fresh_pair.target, _ngram(fresh_pair), 2, k_max=2)
    assert policy.step_cost.widths[1].probes[0][1] == stale[0][3]
    dec = SpecDecoder(fresh_pair, method="ragged", proposer="ngram", k="auto", batch_size=2, progress=False)
    dec.speculation = policy
    dec.generate(PROMPTS, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert policy.reprobed
    stored = diskcache.read("step-probes", key)
    assert stored != stale and max(s[3] for s in stored) < min(s[3] for s in stale)


def test_a_probe_on_a_busy_machine_never_replaces_a_faster_record(cache):
    """A fresh probe: this process takes the new times; the disk keeps each point's faster one, so
    a probe slowed by other work on the machine does not slow every later start."""
    pair = tiny_pair()
    key = probe_record(pair)
    measured = costmodel.probe(pair.target, 2, 3)
    fast = [[b, q, s, t / 100] for b, q, s, t in measured]  # a record faster than anything now
    diskcache.write("step-probes", key, fast)
    again = costmodel.probe(pair.target, 2, 3, fresh=True)
    assert [s[3] for s in again] != [s[3] for s in fast]  # the process uses what it measured
    assert diskcache.read("step-probes", key) == fast
    slow = [[b, q, s, t * 100] for b, q, s, t in measured]
    diskcache.write("step-probes", key, slow)
    again = costmodel.probe(pair.target, 2, 3, fresh=True)
    assert diskcache.read("step-probes", key) == [list(s) for s in again]


def test_a_server_probes_a_drifted_fit_when_idle_not_mid_step(cache, monkeypatch):
    """`defer` (the online engine sets it): the drift is noted during steps, and the probe, which
    takes seconds, waits for `idle`, when no request would wait on it."""
    monkeypatch.setattr(speculation, "DRIFT_STEPS", 4)
    pair = tiny_pair()
    key = probe_record(pair)
    stale = [[b, q, s, t * 100] for b, q, s, t in costmodel.probe(pair.target, 2, 3)]
    diskcache.write("step-probes", key, stale)
    fresh_pair = tiny_pair()  # (the pair probed above remembers that probe as measured here)
    policy = speculation.Adaptive(fresh_pair.target, _ngram(fresh_pair), 2, k_max=2)
    policy.defer = True
    policy.step_cost.load = 0.01  # the steps run 100x faster than the cached fit says
    for _ in range(8):
        policy._check_drift()
    assert policy.stale == ["target"] and not policy.reprobed
    assert diskcache.read("step-probes", key) == stale
    policy.idle(stop=lambda: True)  # a request arrived: abandoned, nothing kept, still to do
    assert policy.stale == ["target"] and not policy.reprobed
    assert diskcache.read("step-probes", key) == stale
    policy.idle(stop=lambda: False)
    assert policy.reprobed and not policy.stale
    assert diskcache.read("step-probes", key) != stale


def test_the_online_engine_defers_upkeep_to_a_lull(monkeypatch):
    """Upkeep waits for QUIET_S without requests, and is told how to notice one arriving."""
    from batchspec.engine import online
    from batchspec.engine.online import OnlineEngine
    from batchspec.engine.step import Context

    monkeypatch.setattr(online, "QUIET_S", 0.3)
    pair = tiny_pair()
    policy = speculation.Adaptive(pair.target, _ngram(pair), 2, k_max=2)
    calls = []
    policy.idle = lambda stop=None: calls.append((time.monotonic(), stop))
    ctx = Context(
        target=pair.target, proposer=_ngram(pair), k=2, pad_id=pair.pad_id, device=pair.device, speculation=policy
    )
    started = time.monotonic()
    engine = OnlineEngine(ctx, 2, 512, pair.decode).start()
    try:
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls and calls[0][1]() is False  # no request has arrived
    finally:
        engine.shutdown()
    assert policy.defer and calls[0][0] - started >= 0.3


def _ngram(pair):
    from batchspec.proposers.ngram import NgramProposer

    return NgramProposer(pair.vocab_size)


def _fill_slowly(folder, marker):
    def fill(path):
        time.sleep(0.5)
        (path / "data.txt").write_text(marker)

    return str(diskcache.directory("models", "shared", fill))


def test_two_processes_making_one_directory_at_once(cache):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        found = pool.starmap(_fill_slowly, [(str(cache), "a"), (str(cache), "b")])
    assert found[0] == found[1] == str(cache / "models" / "shared")
    assert (cache / "models" / "shared" / "data.txt").read_text() in ("a", "b")
    assert [p.name for p in (cache / "models").iterdir()] == ["shared"]  # no temporary left behind


def test_a_directory_is_found_only_under_the_key_it_was_made_with(cache):
    fills = []

    def fill(marker):
        return lambda path: (fills.append(marker), (path / "data.txt").write_text(marker))

    a, b = {"weights": "a"}, {"weights": "b"}
    made = diskcache.directory("packages", "x", fill("a"), key=a)
    assert diskcache.complete("packages", "x", a) == made and diskcache.complete("packages", "x", b) is None
    assert diskcache.directory("packages", "x", fill("a"), key=a) == made and fills == ["a"]  # found, not made
    assert diskcache.directory("packages", "x", fill("b"), key=b) == made and fills == ["a", "b"]  # made again
    assert (made / "data.txt").read_text() == "b" and diskcache.complete("packages", "x", a) is None
    assert [p.name for p in (cache / "packages").iterdir()] == ["x"]  # no temporary left behind


def test_two_processes_tuning_at_once_then_a_third_finds_it_all(cache):
    command = [sys.executable, "-m", "batchspec.cli", "tune", "--pair", "tiny", "--batch-sizes", "2"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        assert "cache" not in err, err[-2000:]  # no warning about an unreadable or unwritable cache
    for path in cache.rglob("*.json"):
        json.loads(path.read_text())  # every record whole
    third = subprocess.run([*command, "--json", str(cache.parent / "t.json")], capture_output=True, text=True)
    assert third.returncode == 0, third.stderr[-2000:]
    (run,) = json.loads((cache.parent / "t.json").read_text())["runs"]
    assert run["tuning"] == "cached" and run["tuning_s"] < 5


def test_tune_refuses_when_the_cache_is_off(monkeypatch):
    from batchspec.cli import main

    monkeypatch.setenv(diskcache.ENV, os.environ.get(diskcache.ENV, ""))  # restored after: main sets it

    assert main(["tune", "--pair", "tiny", "--no-tuning-cache"]) == 2
    assert main(["generate", "--pair", "tiny", "--tuning-cache", "x", "--no-tuning-cache", "hi"]) == 2


def test_linear_forms_choices_come_back_from_disk(cache):
    pair = tiny_pair()
    linears.prepare(pair.target, 4)
    table = next(m.table for m in pair.target.modules() if isinstance(m, linears.TunedLinear))
    again = tiny_pair()
    table2 = next(m.table for m in again.target.modules() if isinstance(m, linears.TunedLinear))
    before = diskcache.tally.copy()
    linears.prepare(again.target, 4)
    assert table2.choice == table.choice
    assert (diskcache.tally - before)["measured"] == 0


def test_the_gguf_conversion_gives_the_gguf_weights_and_tokenizer(default_pair, monkeypatch):
    """The default pair (loaded through the session's cache: converted once, then read from the
    converted directory) against the GGUF read directly with the cache off."""
    assert default_pair.startup["weights"] in ("converted the GGUF", "cached GGUF conversion")
    session = os.environ[diskcache.ENV]
    monkeypatch.setenv(diskcache.ENV, "off")
    direct, tokenizer = models._load_gguf(models.smollm2_path(), torch.float32)
    ours, theirs = default_pair.target.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    mine = {k: v for k, v in default_pair.target.config.to_dict().items() if k not in ("_name_or_path",)}
    assert mine == {
        k: v for k, v in direct.config.to_dict().items() if k not in ("_name_or_path", "quantization_config")
    }
    for text in ["Hello world! ünïcödé 🙂  two  spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>"]:
        assert default_pair.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ours_chat = default_pair.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours_chat == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert default_pair.eos_ids == models._make_pair("x", direct, None, tokenizer).eos_ids
    monkeypatch.setenv(diskcache.ENV, session)
    half = models.load_pair("default", dtype="bfloat16").target.state_dict()  # from the converted directory
    assert all(torch.equal(half[name], theirs[name].to(torch.bfloat16)) for name in theirs)


def test_a_fit_measured_in_this_process_is_left_to_the_online_factors(cache, monkeypatch):
    monkeypatch.setattr(speculation, "DRIFT_STEPS", 4)
    pair = tiny_pair()
    policy = speculation.Adaptive(pair.target, _ngram(pair), 2, k_max=2)  # measured: the cache is empty
    assert not costmodel.from_disk(pair.target, 2, 3)
    policy.step_cost.load = 10.0  # far outside the band
    for _ in range(8):
        policy._check_drift()
    assert not policy.reprobed
