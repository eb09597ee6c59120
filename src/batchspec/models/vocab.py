"""A reduced draft vocabulary, learned as the draft runs (`--draft-vocab N`; FR-Spec's idea).

A large vocabulary makes a small draft's LM head its largest layer: Gemma 3 270M's is 262,144 x
640, more bytes in int8 than its 18 decoder layers. Most of those tokens never occur in a
workload: Spec-Bench's 480 prompts use 16,419 distinct Gemma 3 tokens (14,613 of SmolLM2's). FR-Spec
restricts the draft's head to the most frequent tokens of a corpus; a corpus's counts cannot ship
for every tokenizer, and token ids are no proxy for frequency in a multilingual vocabulary (Gemma
3's lowest 32,768 ids hold 70% of Spec-Bench's prompt tokens, SmolLM2's 97%). So `GrowingHead`
learns its rows from what the draft is fed: it starts from the lowest `seed` ids and adds every
token the draft model reads (the prompts, then each token the target commits), up to `capacity`
rows, never evicting one.

Exactness does not depend on it: a token the head lacks is never drafted, and the target's own
token is committed where the draft could not propose it. The rows fill a buffer of `capacity`
rows in order, so the head's weight is the buffer's first n rows (a contiguous view the kernels
take as is); int8 with one scale per row (quant.py's kernel) where the draft is quantized, else
the draft's dtype.
"""

from __future__ import annotations

import torch

from ..core.errors import BatchspecError
from .quant import int8_product, quantize_int8

#: A self-draft's head rows by default (`--draft-vocab`): measured on Gemma 3 270M and SmolLM2-135M
#: (docs/benchmarks.md, "A reduced draft vocabulary"), where fewer than 10,000 rows are ever filled.
SELF_ROWS = 32768
FULL = "full"  # `--draft-vocab full`: the whole vocabulary


def check(rows) -> None:
    """Refuse a `--draft-vocab` that is neither None, "full" nor an integer >= 1."""
    if rows in (None, FULL) or (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1):
        return
    raise BatchspecError(
        f"--draft-vocab (tokens the draft's head scores) must be an integer >= 1 or full, got {rows!r}"
    )


class GrowingHead(torch.nn.Module):
    """An LM head [.., H] -> [.., n] over the `n` tokens seen so far (`ids`, in row order), made
    from the rows of `source` [V, H] (a full head's weight, read when a token is added, never
    changed). `learn(ids)` adds the unseen ones."""

    def __init__(self, source: torch.Tensor, capacity: int, dtype: torch.dtype, quantized: bool, seed: int):
        super().__init__()
        vocab, hidden = source.shape
        self.source, self.capacity, self.quantized, self.dtype = source, min(capacity, vocab), quantized, dtype
        device = source.device
        weight_dtype = torch.int8 if quantized else dtype
        self.register_buffer("weight", torch.zeros(self.capacity, hidden, dtype=weight_dtype, device=device))
        self.register_buffer(
            "scales", torch.zeros(self.capacity if quantized else 0, dtype=torch.bfloat16, device=device)
        )
        self.register_buffer("rows", torch.zeros(self.capacity, dtype=torch.long, device=device))  # row -> full id
        self.register_buffer("known", torch.zeros(vocab, dtype=torch.bool, device=device))  # [V]
        self.n = 0
        self.learn(torch.arange(min(seed, self.capacity), device=device))

    @property
    def ids(self) -> torch.Tensor:
        """[n] full-vocabulary id of each logit column."""
        return self.rows[: self.n]

    def learn(self, ids: torch.Tensor) -> None:
        """Add the ids (any shape) not held yet, while rows are free."""
        if self.n == self.capacity:
            return
        new = ids.flatten().unique()
        new = new[~self.known[new]][: self.capacity - self.n]
        if not len(new):
            return
        span = slice(self.n, self.n + len(new))
        if self.quantized:
            self.weight[span], self.scales[span] = quantize_int8(self.source[new])
        else:
            self.weight[span] = self.source[new].to(self.dtype)
        self.rows[span] = new
        self.known[new] = True
        self.n += len(new)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] -> logits [.., n] in hidden's dtype."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        weight = self.weight[: self.n]
        if self.quantized:
            out = int8_product(rows.to(torch.bfloat16).contiguous(), weight, self.scales[: self.n])
        else:
            out = torch.nn.functional.linear(rows.to(self.dtype), weight)
        return out.reshape(*hidden.shape[:-1], self.n).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"rows={self.n}/{self.capacity}, vocab={len(self.known)}, {'int8' if self.quantized else self.dtype}"


def reduce_head(
    model: torch.nn.Module, capacity: int, dtype: torch.dtype, quantized: bool, source: torch.Tensor | None = None
) -> GrowingHead:
    """Replace `model`'s LM head with a GrowingHead of `capacity` rows (in `dtype`, or int8) made
    from `source` (default: the head's own weight), seeded with the lowest capacity / 4 ids."""
    source = (model.get_output_embeddings().weight if source is None else source).detach()
    grown = GrowingHead(source, capacity, dtype, quantized, seed=capacity // 4)
    model.set_output_embeddings(grown)
    if "batchspec_source" in model.__dict__:  # what its timings are cached under (diskcache.model_identity)
        model.batchspec_source += f":vocab-{capacity}"
    return grown
