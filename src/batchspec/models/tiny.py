"""The `tiny` pair: a seeded Llama-style target and a perturbed copy as its draft, built from
configs in a second (no download), with a byte-level tokenizer. `tiny-sliding` is the same built
from a Gemma 3-style config: sliding-window layers (a window of 6) around a global one.

Non-degenerate on purpose: with transformers' default init scale a random model's greedy output
repeats one or two tokens, and a test on such output cannot see a wrong position or mask. An init
scale of 0.2 gives varied output; a draft equal to the target plus Gaussian noise of `noise` x
each weight's std gives mixed acceptance (some rows accept all, some none).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from . import attention

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 256, 257, 258


def byte_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Bytes 0..255 are ids 0..255, then <pad>, <s>, </s>, then unused `<extra_i>` up to vocab_size."""
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + len(SPECIALS)}, got {vocab_size}")
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    extras = [f"<extra_{i}>" for i in range(vocab_size - 256 - len(SPECIALS))]
    for i, tok in enumerate(SPECIALS + tuple(extras)):
        vocab[tok] = 256 + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": extras})
    return tok


def tiny_config(vocab_size: int = 320, hidden: int = 64, layers: int = 2, context: int = 8192) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.2,
        pad_token_id=256 if vocab_size > 256 else 0,
        bos_token_id=257 if vocab_size > 257 else 0,
        eos_token_id=258 if vocab_size > 258 else vocab_size - 1,
        tie_word_embeddings=False,
    )


def tiny_sliding_config(vocab_size: int = 320, hidden: int = 64, window: int = 6, context: int = 8192):
    """A Gemma 3-style text config: layers 0 and 2 attend over a sliding window of `window` keys,
    layer 1 over everything (Gemma 3 has five sliding layers per global one)."""
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=window,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        query_pre_attn_scalar=hidden // 4,
        max_position_embeddings=context,
        initializer_range=0.2,
        pad_token_id=256,
        bos_token_id=257,
        eos_token_id=258,
        tie_word_embeddings=False,
    )


def tiny_models(
    config: PreTrainedConfig, noise: float = 0.02, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(target, draft) of `config`'s architecture: the draft is the target with each weight
    perturbed by noise x its std."""
    torch.manual_seed(seed)
    target = attention.install(AutoModelForCausalLM.from_config(config).eval())
    draft = attention.install(AutoModelForCausalLM.from_config(config).eval())
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    return target.to(dtype), draft.to(dtype)


def tiny_head(
    target: LlamaForCausalLM,
    noise: float = 0.02,
    seed: int = 0,
    feature_mix: float = 0.005,
    aux_layers: tuple[int, ...] = (),
):
    """An EAGLE-style head (eagle.py) for a tiny target: its layer is the target's last layer plus
    noise, `fc` passes the token embedding through and mixes in `feature_mix` x a random map of
    the feature (and of each `aux_layers` output: so wrong features change its output), the reduced
    vocabulary drops every 7th id. Over a 1-layer target it predicts the target's features
    closely: mixed acceptance."""
    from .draft import draft_config
    from .eagle import EagleHead

    config = target.config
    vocab_ids = torch.tensor([i for i in range(config.vocab_size) if i % 7 != 3])
    gen = torch.Generator().manual_seed(seed + 2)
    head = EagleHead(draft_config(config, 1), vocab_ids, aux_layers)
    hidden = config.hidden_size
    with torch.no_grad():
        head.model.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        head.model.norm.load_state_dict(target.model.norm.state_dict())
        for p in head.model.layers[0].parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * p.std() * noise)
        mix = torch.randn(hidden, head.feature_size, generator=gen) * feature_mix / hidden**0.5
        head.fc.weight.copy_(torch.cat([torch.eye(hidden), mix], dim=1))
        head.fc.bias.zero_()
    head.to(target.dtype)
    head.share_target(target)
    return head.eval()
