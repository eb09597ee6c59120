"""Bad input gets a clear BatchspecError naming the problem, never a traceback from torch."""

from __future__ import annotations

import warnings

import pytest

from batchspec import BatchspecError, EngineConfig, SamplingParams, SpecDecoder, tiny_pair
from batchspec.cli import main
from batchspec.models import pair as models
from batchspec.models.pair import check_vocab, load_pair


def test_vocab_mismatch_is_refused():
    small, big = tiny_pair(vocab_size=320), tiny_pair(vocab_size=384)
    with pytest.raises(BatchspecError, match=r"tokenizer mismatch.*320.*384"):
        check_vocab(small.target, small.tokenizer, big.draft, big.tokenizer)
    small.draft = big.draft  # a hand-built pair with a foreign draft
    with pytest.raises(BatchspecError, match=r"tokenizer mismatch.*320.*384"):
        SpecDecoder(small, method="eqspec")


def test_tokenizers_that_encode_differently_are_refused():
    a, b = tiny_pair(vocab_size=320), tiny_pair(vocab_size=320)
    b.tokenizer.add_tokens(["decoding"])  # same model vocabulary, different tokenizer
    with pytest.raises(BatchspecError, match="tokenizer mismatch"):
        check_vocab(a.target, a.tokenizer, b.draft, b.tokenizer)


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt(tiny32, prompt):
    with pytest.raises(BatchspecError, match="empty prompt"):
        SpecDecoder(tiny32, method="eqspec").generate([prompt])


def test_prompt_longer_than_context(tiny32):
    with pytest.raises(BatchspecError, match=r"prompt 1 has 8192 tokens.*context of 8192"):
        SpecDecoder(tiny32, method="ar").generate([[1, 2], [5] * 8192])


def test_token_out_of_vocabulary(tiny32):
    with pytest.raises(BatchspecError, match="outside the vocabulary"):
        SpecDecoder(tiny32, method="ar").generate([[1, 999]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": 0}, "k .* must be an integer >= 1"),
        ({"k": -2}, "k .* must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size must be"),
        ({"method": "nope"}, "unknown method 'nope'"),
        ({"proposer": "oracle"}, "unknown proposer"),
        ({"batch_size": 8, "window_size": 4}, r"window_size \(4\) must be >= batch_size \(8\)"),
    ],
)
def test_engine_config_errors(kwargs, message):
    with pytest.raises(BatchspecError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
    ],
)
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(BatchspecError, match=message):
        SamplingParams(**kwargs)


def test_missing_draft_names_the_way_out(tiny32):
    tiny32_no_draft = tiny_pair()
    tiny32_no_draft.draft = None
    with pytest.raises(BatchspecError, match="--proposer ngram"):
        SpecDecoder(tiny32_no_draft, method="eqspec", proposer="draft")


def test_unknown_pair_and_missing_files():
    with pytest.raises(BatchspecError, match="unknown pair 'huge'"):
        load_pair("huge")
    with pytest.raises(BatchspecError, match="GGUF file not found"):
        load_pair(target="/nonexistent/model.gguf")
    with pytest.raises(BatchspecError, match="unknown dtype"):
        load_pair("tiny", dtype="int3")


def test_unreachable_hub_is_explained(monkeypatch):
    monkeypatch.setattr("batchspec.models.pair.hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(BatchspecError, match="from the Hugging Face hub.*the hub is unreachable from this machine"):
        load_pair(target="someone/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BatchspecError, match="HF_HUB_OFFLINE is set"):
        load_pair(target="someone/no-such-model")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--pair", "tiny", "-k", "0", "hi"], "k .* must be an integer >= 1"),
        (["generate", "--pair", "tiny", "--max-new-tokens", "0", "hi"], "max_new_tokens must be"),
        (["generate", "--pair", "tiny", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["generate", "--pair", "tiny", ""], "empty prompt"),
        (["generate", "--pair", "tiny", "--prompts", "/nonexistent.jsonl"], "prompt file not found"),
        (["generate", "--pair", "tiny", "--proposer", "eagle", "--branches", "4x0", "hi"], "branches .* integer >= 1"),
        (["bench", "--pair", "tiny", "--branches", "1,3xb", "hi"], "--branches: expected .* like 4x2x1, got '3xb'"),
        (["generate", "--pair", "tiny", "--draft", "/d", "hi"], "either --pair or --target/--draft.*with --draft"),
        (["generate", "--pair", "tiny", "--target", "/t", "hi"], "either --pair or --target/--draft.*with --target"),
        (["generate", "--draft", "/d", "hi"], "--draft needs --target"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchspec: error:") and "Traceback" not in err
    assert __import__("re").search(message, err)


@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_on_a_cpu_without_it_is_flagged(monkeypatch, native):
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_pair("tiny", dtype="bfloat16", device="cpu")
        load_pair("tiny", dtype="float32", device="cpu")
    flagged = [w for w in caught if "bfloat16 on this CPU is emulated" in str(w.message)]
    assert len(flagged) == (0 if native else 1)


@pytest.mark.parametrize("ms", [-1, 5000])
def test_arrival_window_out_of_range(ms):
    from batchspec.serving.config import ServeConfig

    with pytest.raises(BatchspecError, match=f"--arrival-window-ms must be between 0 and 1000, got {ms}"):
        ServeConfig(arrival_window_ms=ms)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_itl_ms", -1, "--max-itl-ms must be >= 0"),
        ("max_itl_steps", 0.5, "--max-itl-steps must be 0 \\(no bound\\) or >= 1"),
        ("max_itl_steps", -2, "--max-itl-steps must be 0"),
    ],
)
def test_a_gap_bound_out_of_range(field, value, message):
    from batchspec.serving.config import ServeConfig

    with pytest.raises(BatchspecError, match=message):
        ServeConfig(**{field: value})


def test_an_unknown_spin_mode_is_refused_by_the_cli_and_the_config(capsys):
    from batchspec.cli import build_parser
    from batchspec.serving.config import ServeConfig

    with pytest.raises(BatchspecError, match="--spin must be one of off, on, auto, got 'fast'"):
        ServeConfig(spin="fast")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--spin", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--spin"]).spin == "on"  # bare: always spin
    assert build_parser().parse_args(["serve"]).spin == "auto"
