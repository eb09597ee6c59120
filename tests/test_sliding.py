"""Sliding-window models (Gemma 3-style `tiny-sliding`: layers 0 and 2 see a window of 6 keys,
layer 1 everything): the reference equals transformers' own generate with its sliding caches and
eager attention, and every method, proposer, k, tree and batch gives the reference's tokens,
with prompts and outputs far longer than the window (float64, as the other property tests)."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
import torch
from helpers import decode_checked, random_prompts, reference_tokens
from hypothesis import given, settings

from batchspec import BatchspecError, EngineConfig, SamplingParams, SpecDecoder, tiny_pair
from batchspec.models import attention, invariant, support
from batchspec.models.pair import load_pair
from batchspec.models.support import check_supported

WINDOW = 6
#: The sizes of the small configs the refusal tests build (no weights are ever used).
SMALL = dict(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)


@pytest.fixture(scope="module")
def sliding64():
    return tiny_pair(dtype=torch.float64, sliding=True)


def test_the_pair_is_gemma3_with_sliding_and_global_layers(sliding64):
    config = sliding64.target.config
    assert config.model_type == "gemma3_text" and config.sliding_window == WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_reference_equals_transformers_generate_with_its_sliding_cache(sliding64):
    """The oracle's oracle: transformers' eager attention over its DynamicSlidingWindowLayer cache
    (which keeps only the last window - 1 entries), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(sliding64.target.config)  # from_config would set eager on the pair's own
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(torch.float64).eval()
    hf.load_state_dict(sliding64.target.state_dict())
    prompts = random_prompts(70, 4, 2, 40)
    ref = reference_tokens(sliding64, prompts, 24)
    for prompt, want in zip(prompts, ref):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=256)
        assert out[0, len(prompt) :].tolist()[: len(want)] == want


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10**6),
    method=st.sampled_from(["ar", "spec1", "eqspec", "exspec", "ragged"]),
    proposer=st.sampled_from(["draft", "ngram", "ngram+draft"]),
    batch=st.integers(1, 5),
    k=st.sampled_from([1, 2, 3, 5]),
)
def test_every_method_equals_the_reference(sliding64, seed, method, proposer, batch, k):
    prompts = random_prompts(seed, 7, 1, 40)
    got, _ = decode_checked(
        sliding64, prompts, SamplingParams(max_new_tokens=28), proposer, method=method, batch_size=batch, k=k
    )
    assert got == reference_tokens(sliding64, prompts, 28)


@settings(max_examples=6)
@given(
    seed=st.integers(0, 10**6),
    method=st.sampled_from(["eqspec", "ragged"]),
    branches=st.sampled_from([2, (3, 2, 1), (2, 2)]),
    batch=st.integers(1, 4),
)
def test_draft_trees_equal_the_reference(sliding64, seed, method, branches, batch):
    """A tree node sees its ancestors: the window counts them, not the other branches."""
    prompts = random_prompts(seed, 5, 1, 30)
    k = 3 if isinstance(branches, int) else len(branches)
    got, _ = decode_checked(
        sliding64,
        prompts,
        SamplingParams(max_new_tokens=24),
        "draft",
        method=method,
        batch_size=batch,
        k=k,
        branches=branches,
    )
    assert got == reference_tokens(sliding64, prompts, 24)


def test_chunked_prefill_prefix_cache_and_auto_k(sliding64):
    prompts = random_prompts(71, 8, 20, 60)
    prompts += [prompts[0] + [5, 6, 7], prompts[1][:30]]  # reuse of stored prefixes
    config = dict(method="ragged", batch_size=3, k="auto", prefill_chunk=8, prefix_cache_tokens=4096)
    got, _ = decode_checked(sliding64, prompts, SamplingParams(max_new_tokens=20), "ngram+draft", **config)
    assert got == reference_tokens(sliding64, prompts, 20)


def test_without_the_window_the_methods_diverge(sliding64, monkeypatch):
    """The control: attending over the full history in the sliding layers (the window ignored in
    the ragged layout's masks) changes the tokens, so the tests above can fail."""
    monkeypatch.setattr(attention, "windowed", lambda mask, window: mask)
    prompts = random_prompts(72, 4, 20, 40)
    dec = SpecDecoder(sliding64, EngineConfig(method="ragged", batch_size=4, k=3, proposer="draft"))
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=24))]
    assert got != reference_tokens(sliding64, prompts, 24)


def test_windowed_keeps_the_last_keys_of_each_query():
    allowed = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)[None, None]
    kept = attention.windowed(allowed, 3)
    assert kept[0, 0].int().tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    additive = torch.where(allowed, 0.0, float("-inf"))
    assert torch.equal(attention.windowed(additive, 3) == 0, kept)


def test_sampled_rows_match_the_reference_sampler(sliding64):
    """Seeded sampling: the same tokens from the ragged batch as from the target alone."""
    prompts = random_prompts(73, 4, 5, 30)
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=s) for s in range(4)]
    ref = [SpecDecoder(sliding64, method="reference").generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    dec = SpecDecoder(sliding64, EngineConfig(method="ragged", batch_size=4, k=3, proposer="draft"))
    assert [o.token_ids for o in dec.generate(prompts, params)] == ref


def test_soft_capped_attention_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_hidden_layers=2, **SMALL)
    with pytest.raises(BatchspecError, match=r"soft-caps its attention logits \(attn_logit_softcapping=50"):
        check_supported(Gemma2ForCausalLM(config), "target")


def test_the_batch_invariant_mode_refuses_sliding_layers_by_name():
    pair = tiny_pair(dtype=torch.float32, sliding=True)
    with pytest.raises(BatchspecError, match="does not support sliding-window attention yet"):
        invariant.install(pair.target)
    assert not invariant.installed(pair.target)


def _gguf_header(path, arch: str) -> None:
    """A GGUF file with metadata and no tensors: all an architecture check may read."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "why"), [("mamba", "recurrent state"), ("gemma2", "soft-capped")])
def test_unsupported_gguf_architectures_are_refused_from_the_header(tmp_path, arch, why):
    """Refused before any weight is read: the file holds no tensors at all."""
    path = tmp_path / f"{arch}.gguf"
    _gguf_header(path, arch)
    assert support.gguf_architecture(str(path)) == arch
    with pytest.raises(BatchspecError, match=rf"the target model \({arch}, .*\) has {why}"):
        load_pair(target=str(path))


def test_a_recurrent_model_directory_is_refused_from_its_config(tmp_path):
    """A directory holding only a config (no weights): refused by the config, before loading."""
    from transformers import MambaConfig

    MambaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(BatchspecError, match=r"the target model \(mamba\) keeps recurrent state"):
        load_pair(target=str(tmp_path))


def test_the_default_pairs_gguf_header_reads_llama():
    from batchspec.models.pair import smollm2_path

    assert support.gguf_architecture(smollm2_path()) == "llama"
    assert support.gguf_architecture(__file__) is None  # not a GGUF file


def test_chunked_attention_and_recurrent_models_are_refused_from_the_config():
    from transformers import Llama4TextConfig, RwkvConfig

    # transformers caches Llama 4's chunked layers as sliding ones: only the config tells them apart
    chunked = Llama4TextConfig(num_hidden_layers=4, intermediate_size_mlp=64, **SMALL)
    with pytest.raises(BatchspecError, match=r"llama4_text\) has layers of kind \['chunked_attention'\]"):
        support.check_config(chunked, "target")
    with pytest.raises(BatchspecError, match=r"the draft model \(rwkv\) keeps recurrent state"):
        support.check_config(RwkvConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1), "draft")
    support.check_config(tiny_pair(sliding=True).target.config, "target")  # sliding layers pass


def test_a_hyphenated_or_malformed_gguf_header(tmp_path):
    """llama.cpp spells gpt-oss with a hyphen (refused all the same); an old or truncated header
    reads as unknown, never as an exception from the parser."""
    _gguf_header(tmp_path / "oss.gguf", "gpt-oss")
    with pytest.raises(BatchspecError, match=r"\(gpt_oss, .*\) has attention sinks"):
        support.check_gguf(str(tmp_path / "oss.gguf"), "target")
    good = (tmp_path / "oss.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:30])
    assert support.gguf_architecture(str(tmp_path / "cut.gguf")) is None
    (tmp_path / "v1.gguf").write_bytes(good[:4] + (1).to_bytes(4, "little") + good[8:])
    assert support.gguf_architecture(str(tmp_path / "v1.gguf")) is None
    huge = good[:24] + (1 << 40).to_bytes(8, "little") + good[32:]  # the first key's length, absurd
    (tmp_path / "huge.gguf").write_bytes(huge)
    assert support.gguf_architecture(str(tmp_path / "huge.gguf")) is None


def test_windowed_leaves_short_masks_alone_and_takes_the_layers_window_from_its_config(sliding64):
    mask = torch.ones(1, 1, 3, WINDOW, dtype=torch.bool).tril(WINDOW - 3)
    assert attention.windowed(mask, WINDOW) is mask
    layers = sliding64.target.model.layers
    assert [attention._layer_window(layer.self_attn) for layer in layers] == [WINDOW, None, WINDOW]
