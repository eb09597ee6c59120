"""Prefix caching: the KV entries of rows that left the batch, found again by their tokens.

When a row leaves a ragged batch (finished or cancelled), its entries of every role (as the batch
holds them: the committed tokens but the last) are kept here, with the target's features a draft
head reads (eagle.Features). A later prompt that begins with the same tokens starts from them:
admission builds its one-row prefill batch with those entries already cached and feeds only the
rest of the prompt (admission.py). Chats resend their history each turn, so turn t + 1 starts from
all of turn t; a shared system prompt is prefilled once while it stays cached.

Lookup is by blocks of `BLOCK` tokens, each named by a chain hash of every block up to it (as
vLLM's prefix caching names its blocks): a hit is the longest run of whole blocks a stored entry
shares with the prompt, at most the prompt's length - 1 (its last token is always fed, for its
logits); the tokens are compared before a hit is used, so a hash collision is a miss. Memory is
bounded by `max_tokens` entries held (the target's), least recently used evicted first; an entry
whose tokens a new one extends is dropped (the longer one serves both).

Exactness: a stored entry is the model's function of the same tokens at the same positions, so a
prompt continued from it gets the tokens it gets without the cache; in float32 the entries may
differ in the last bits from a prefill's (another forward shape), as any batched forward's do.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from . import kv

BLOCK = 16  # tokens per hashed block: the granularity of a hit


def _nbytes(stored: dict[str, kv.SeqKV], features: torch.Tensor | None) -> int:
    """Bytes of an entry's tensors."""
    tensors = [t for layers in stored.values() for pair in layers for t in pair]
    return sum(t.nbytes for t in tensors) + (features.nbytes if features is not None else 0)


def reusable(shared: int, length: int) -> int:
    """Tokens a prompt of `length` tokens would start from, given that its first `shared` tokens
    are stored: whole blocks, never its last token, and only where they cover at least half of it
    (a prompt prefilled alone from a short hit, such as a chat template's default system prompt,
    costs about what it saves, beside being prefilled in one forward with the others waiting);
    else 0."""
    reused = min(shared, length - 1) // BLOCK * BLOCK
    return reused if reused and 2 * reused >= length else 0


def would_reuse(seq, others: list) -> bool:
    """Whether `seq` would start from the stored prompt entries of one of `others` (`reusable`)."""
    for other in others:
        pairs = zip(seq.token_ids, other.prompt_ids)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(seq), other.prompt_len))
        if reusable(same, len(seq)):
            return True
    return False


@dataclass
class Entry:
    """A stored row: `tokens` (those the target's entries hold), each role's entries (cloned;
    a role may hold fewer, `counts`), and the target's features by position (or None)."""

    key: int  # its name in the store
    tokens: list[int]
    kv: dict[str, kv.SeqKV]
    counts: dict[str, int]
    features: torch.Tensor | None


@dataclass
class Hit:
    """A stored entry whose first `length` tokens begin a prompt."""

    length: int
    entry: Entry


class PrefixCache:
    """Stored rows by chain-hashed blocks; `features`: the proposer's eagle.Features, or None."""

    def __init__(self, max_tokens: int, features=None, block: int = BLOCK):
        self.max_tokens, self.features, self.block = max_tokens, features, block
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # key -> entry, least recently used first
        self.index: dict[int, int] = {}  # chain hash of blocks 0..j -> the key of an entry holding them
        self.held = 0  # target entries held
        self.held_bytes = 0  # all roles' entries and the features, in bytes
        self.next_key = 0
        self.lookups = self.hits = self.prompt_tokens = self.reused_tokens = 0

    def _hashes(self, tokens: list[int], limit: int) -> list[int]:
        """Chain hashes of the whole blocks within tokens[:limit]."""
        out, h = [], 0
        for start in range(0, limit - self.block + 1, self.block):
            h = hash((h, tuple(tokens[start : start + self.block])))
            out.append(h)
        return out

    def worth(self, tokens: list[int]) -> Hit | None:
        """`match`, where the hit is worth starting from (`reusable`)."""
        hit = self.match(tokens)
        return hit if hit is not None and reusable(hit.length, len(tokens)) else None

    def match(self, tokens: list[int]) -> Hit | None:
        """The longest stored prefix of `tokens` in whole blocks, at most len(tokens) - 1 long."""
        best = None
        for j, h in enumerate(self._hashes(tokens, len(tokens) - 1)):
            key = self.index.get(h)
            if key is None:
                break
            best = (key, (j + 1) * self.block)
        if best is None:
            return None
        entry = self.entries[best[0]]
        if entry.tokens[: best[1]] != tokens[: best[1]]:  # a hash collision
            return None
        return Hit(best[1], entry)

    def take(self, seq, hit: Hit | None, models: dict) -> dict:
        """Caches (role -> kv.BufferCache) to prefill `seq` from: `hit`'s entries of each role in
        `models` (role -> model), empty where there is no hit; restores the head's features.
        Counts the lookup."""
        self.lookups += 1
        self.prompt_tokens += seq.prompt_len
        caches = kv.empty_caches(models)
        if hit is None:
            return caches
        self.hits += 1
        self.reused_tokens += hit.length
        entry = hit.entry
        self.entries.move_to_end(entry.key)  # the most recently used now
        for role, model in models.items():
            n = min(hit.length, entry.counts.get(role, 0))
            if n:
                caches[role] = kv.stack(model.config, [entry.kv[role]], [n])
        if self.features is not None and entry.features is not None:
            self.features.rows[seq] = entry.features[: hit.length].clone()
        return caches

    def put(self, seq, entries: dict[str, kv.SeqKV], counts: dict[str, int]) -> None:
        """Keep a leaving row's entries (role -> the row's first counts[role] entries, views)."""
        n = counts.get("target", 0)
        if n < self.block or n > self.max_tokens:
            return
        tokens = seq.token_ids[:n]
        old = self.match(tokens + [-1])
        if old is not None and len(old.entry.tokens) <= n and old.entry.tokens == tokens[: len(old.entry.tokens)]:
            self._drop(old.entry.key)
        stored = {role: [(k.clone(), v.clone()) for k, v in entries[role]] for role in entries if counts[role]}
        features = self.features.rows.get(seq) if self.features is not None else None
        features = None if features is None or features.shape[0] < n else features[:n].clone()
        key, self.next_key = self.next_key, self.next_key + 1
        self.entries[key] = Entry(key, tokens, stored, {r: counts[r] for r in stored}, features)
        for h in self._hashes(tokens, n):
            self.index[h] = key
        self.held += n
        self.held_bytes += _nbytes(stored, features)
        while self.held > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.held -= len(entry.tokens)
        self.held_bytes -= _nbytes(entry.kv, entry.features)
        for h in self._hashes(entry.tokens, len(entry.tokens)):
            if self.index.get(h) == key:
                del self.index[h]

    def summary(self) -> dict:
        """Lookups, hits, and the share of admitted prompt tokens that were not prefilled."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "token_hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "held_tokens": self.held,
            "held_bytes": self.held_bytes,
        }
