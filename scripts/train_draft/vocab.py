"""The reduced vocabulary: the V_r most frequent tokens of what the target writes, with the
tokens a chat needs (EOS, chat markers, role names) always in.

Invariant: the result is sorted, unique, of exactly the requested size, and holds every forced id.
"""

from __future__ import annotations

import torch

# Looked up in the tokenizer; tokens it lacks are skipped (SmolLM2's chat markers and roles).
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_WORDS = ("\n", "assistant", "user", "system")
PROMPT_WEIGHT = 0.1  # a prompt token counts this much, an answer token 1


def forced_ids(tokenizer, eos_ids) -> list[int]:
    """Ids the draft must be able to propose: the pair's EOS ids, the tokenizer's special tokens
    (bos, eos, pad, unk), the chat markers it has, and the pieces of the chat role names."""
    ids = set(eos_ids)
    ids.update(getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk"))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in CHAT_TOKENS if token in vocab)
    for word in CHAT_WORDS:
        ids.update(tokenizer.encode(word, add_special_tokens=False))
    return sorted(i for i in ids if i is not None)


def choose_vocab(records: list[dict], size: int, forced: list[int], vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens (answer tokens count 1, prompt tokens PROMPT_WEIGHT; ties and
    unseen tokens: lower id first, i.e. the tokenizer's earlier merges), `forced` always in.
    Returns sorted full-vocabulary ids [size]."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts += torch.bincount(r["tokens"][r["n_prompt"] :].long(), minlength=vocab_size).double()
        counts += PROMPT_WEIGHT * torch.bincount(r["tokens"][: r["n_prompt"]].long(), minlength=vocab_size).double()
    score = counts - torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # tie-break: low id first
    score[torch.tensor(forced, dtype=torch.long)] = float("inf")
    return torch.sort(score.topk(size).indices).values


def coverage(records: list[dict], vocab_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of answer tokens that the reduced vocabulary (`vocab_ids` [V_r]) contains."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    answers = torch.cat([r["tokens"][r["n_prompt"] :].long() for r in records])
    return float(inside[answers].float().mean())
