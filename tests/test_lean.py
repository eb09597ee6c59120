"""The lean decoder layer (models/lean.py) computes transformers' Llama-form layer: the same
logits within rounding, with and without a cache, at every position; layers it does not compute
are left as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from batchspec import tiny_pair
from batchspec.models import lean, quant


def _model(kind: str) -> torch.nn.Module:
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q, k, v
        return Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    if kind == "qwen3":  # an RMS norm over each head of q and k before RoPE, head_dim apart from the width
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=24)).eval()
        with torch.no_grad():  # norms away from their initial ones, so a norm left out shows
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
        return model
    return LlamaForCausalLM(
        LlamaConfig(
            **shape,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_lean_layers_compute_the_same_logits(kind):
    model = _model(kind)
    leaned = copy.deepcopy(model)
    assert lean.install(leaned) == 3
    assert all(isinstance(layer, lean.LeanLayer) for layer in leaned.model.layers)
    ids = torch.randint(0, 97, (2, 21))
    want = model(input_ids=ids).logits
    got = leaned(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # fed in pieces over a cache: a prompt, then one token, then three
    caches = [DynamicCache(config=m.config) for m in (model, leaned)]
    for lo, hi in ((0, 15), (15, 16), (16, 19)):
        outs = [m(input_ids=ids[:, lo:hi], cache=c, use_cache=True).logits for m, c in zip((model, leaned), caches)]
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)


def test_layers_it_does_not_compute_are_left_alone():
    from transformers import MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    windowed = MistralForCausalLM(MistralConfig(**shape, num_key_value_heads=2, sliding_window=8)).eval()
    before = [type(layer) for layer in windowed.get_decoder().layers]
    draft = quant.self_draft(windowed, "int8", torch.float32)
    assert [type(layer) for layer in draft.get_decoder().layers] == before


@torch.inference_mode()
def test_gemma3_layers_are_lean_and_compute_the_same_logits():
    """The tiny-sliding pair's Gemma 3 layers (four norms of their own form, per-head q and k norms, a
    GELU MLP, windows of 6 keys on layers 0 and 2, a RoPE table per kind): the same logits as
    transformers' layers over prompts longer than the window, whole and fed over a cache."""
    model = tiny_pair(dtype=torch.float64, sliding=True).target
    with torch.no_grad():  # norms away from their initial zeros, so a norm left out or misread shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(len(name)))
    leaned = copy.deepcopy(model)
    assert lean.install(leaned) == 3
    ids = torch.randint(0, 256, (2, 21))
    torch.testing.assert_close(leaned(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=1e-6)
    caches = [DynamicCache(config=m.config) for m in (model, leaned)]  # transformers' sliding layers
    for lo, hi in ((0, 15), (15, 16), (16, 19)):
        outs = [m(input_ids=ids[:, lo:hi], cache=c, use_cache=True).logits for m, c in zip((model, leaned), caches)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    state = leaned.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())


@pytest.mark.parametrize("kind", ["tiny", "qwen3"])
def test_a_self_draft_gets_lean_layers_and_agrees_with_its_target(kind):
    """A self-draft (int8) of the tiny pair's target, and of a Qwen3 model: every layer lean, and
    its greedy choice the target's at nearly every position of a teacher-forced sequence."""
    target = tiny_pair(dtype=torch.float32).target if kind == "tiny" else _model(kind)
    draft = quant.self_draft(target, "int8", torch.float32)
    assert all(isinstance(layer, lean.LeanLayer) for layer in draft.get_decoder().layers)
    ids = torch.randint(0, 97, (1, 64))
    with torch.inference_mode():
        agree = (draft(input_ids=ids).logits.argmax(-1) == target(input_ids=ids).logits.argmax(-1)).float()
    assert agree.mean() > 0.9


@pytest.mark.parametrize("window", [None, 8])
def test_windowed_layers_keep_transformers_layers(window):
    """A Mistral-style model: lean layers without a window, transformers' layers with one (the
    lean layer does not cut masks to a window)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
    )
    model = MistralForCausalLM(config).eval()
    assert lean.install(model) == (2 if window is None else 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_a_model_with_lean_layers_saves_as_the_model_it_was_made_from(kind, tmp_path):
    model = _model(kind)
    want = {name: t.clone() for name, t in model.state_dict().items()}
    lean.install(model)
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    model.save_pretrained(tmp_path)  # and back: transformers' own layers from the saved files
    again = type(model).from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 11))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, again(input_ids=ids).logits, atol=2e-5, rtol=1e-4)
