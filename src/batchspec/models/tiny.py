"""The `tiny` pair: a seeded Llama-style target and a perturbed copy as its draft, built from
configs in a second (no download), with a byte-level tokenizer.

Non-degenerate on purpose: with transformers' default init scale a random model's greedy output
repeats one or two tokens, and a test on such output cannot see a wrong position or mask. An init
scale of 0.2 gives varied output; a draft equal to the target plus Gaussian noise of `noise` x
each weight's std gives mixed acceptance (some rows accept all, some none).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
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


def tiny_models(
    config: LlamaConfig, noise: float = 0.02, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(target, draft): the draft is the target with each weight perturbed by noise x its std."""
    torch.manual_seed(seed)
    target = attention.install(LlamaForCausalLM(config).eval())
    draft = attention.install(LlamaForCausalLM(config).eval())
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
