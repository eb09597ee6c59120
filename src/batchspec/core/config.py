"""Validated parameter objects: `SamplingParams` (per request) and `EngineConfig` (per decoder).

Both check themselves in `__post_init__`, so a bad value fails where it is written, with a message
naming it, never later inside torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import methods, tree
from .errors import BatchspecError
from .grammar import KINDS, Grammar
from .logprobs import MAX_LOGPROBS

PROPOSERS = ("draft", "ngram", "eagle", "ngram+eagle", "ngram+draft")
#: A combined proposer's name: this prefix, then its model proposer's name (proposer.LookupFirst).
LOOKUP_FIRST = "ngram+"


def model_proposer(name: str | None) -> str | None:
    """The proposer that runs a model in `name` ("draft" or "eagle", also inside "ngram+eagle"),
    else None."""
    model = (name or "").removeprefix(LOOKUP_FIRST)
    return model if model in ("draft", "eagle") else None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: `-k auto`: the most drafts a row verifies in one step (policy/speculation.py chooses 0 .. this).
AUTO_K_MAX = 6


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy (argmax); then top_p/top_k/seed are unused.

    `seed` fixes a request's random stream: the same seed gives the same tokens whatever the batch
    size, the batch's other rows or the (speculative) method. `logprobs = n` (0..20): each emitted
    token comes with its log-probability under the target and the n likeliest tokens' (logprobs.py).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: the text ends right before the first one generated
    logprobs: int | None = None  # per emitted token, its log-probability and this many alternatives
    # Constrained output (at most one; grammar.py): the output follows a JSON schema (a dict or JSON
    # text), a regex, or a Lark grammar, and ends (EOS) only where the grammar accepts it.
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise BatchspecError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise BatchspecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise BatchspecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise BatchspecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise BatchspecError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise BatchspecError(f"seed must be an integer or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise BatchspecError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise BatchspecError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (alternatives per token), "
                f"got {self.logprobs!r}"
            )
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise BatchspecError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
        if given:
            spec = Grammar.of(given[0], getattr(self, given[0]))  # checked here, kept in canonical form
            object.__setattr__(self, given[0], spec.source)
            if self.ignore_eos:
                raise BatchspecError(
                    f"ignore_eos cannot be combined with {given[0]}: the grammar decides where the output ends"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> Grammar | None:
        """The grammar the output must follow, or None."""
        kind = next((kind for kind in KINDS if getattr(self, kind) is not None), None)
        return None if kind is None else Grammar(kind, getattr(self, kind))


@dataclass(frozen=True)
class EngineConfig:
    """How to decode: the method and its knobs.

    k: draft tokens per step (speculative methods): an integer >= 1, or "auto" (the default: each
    step chooses 0 .. AUTO_K_MAX per row from measured costs, speculation.py). branches: candidates
    verified per draft position (1: a chain; C > 1: a draft tree of the proposer's C most likely
    continuations at each depth; a tuple (C_1, C_2, ..): C_d at depth d, the last repeated below;
    tree.py). batch_size: rows per forward pass.
    window_size: EXSPEC's active pool (default 4 x batch_size). min_group: smallest same-length
    group EXSPEC runs without padding (default batch_size). kv_budget_tokens: KV tokens the
    ragged layout's rows may reserve together (default: its batch_size largest requests).
    prefix_cache_tokens: ragged: keep the KV entries of rows that leave, up to this many tokens, and
    start later prompts that share a prefix from them (prefixes.py; None: off; the server's default
    is on). batch_invariant: run the target under the batch-invariant mode (models/invariant.py:
    its logits the same bits alone or in any batch, so greedy output equals `reference`'s in
    bfloat16 too); False: plain kernels; None: leave the model as it is.
    """

    method: str = methods.DEFAULT_METHOD
    k: int | str = "auto"
    batch_size: int = 8
    proposer: str | None = None  # "draft" | "ngram" | "eagle"; None: the pair's default
    branches: int | tuple[int, ...] = 1  # candidates per draft position (or per depth): > 1 drafts a tree (tree.py)
    window_size: int | None = None
    min_group: int | None = None
    kv_budget_tokens: int | None = None
    prefill_chunk: int | None = None  # ragged: prompt tokens prefilled per step; None: unbounded offline,
    # from measured costs in the server
    prefix_cache_tokens: int | None = None
    check_invariants: bool = False
    progress: bool = False
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        methods.get(self.method)  # raises for an unknown name
        if self.k != "auto" and (not _is_int(self.k) or self.k < 1):
            raise BatchspecError(f"k (draft tokens per step) must be an integer >= 1 or 'auto', got {self.k!r}")
        if isinstance(self.branches, list):  # widths per depth, however given
            object.__setattr__(self, "branches", tuple(self.branches))
        widths = tree.listed(self.branches)
        if not widths or not all(_is_int(c) and c >= 1 for c in widths):
            raise BatchspecError(
                "branches (candidates per draft position) must be an integer >= 1 or a tuple of them, one per "
                f"depth, got {self.branches!r}"
            )
        if tree.is_tree(self.branches) and self.proposer == "ngram":
            raise BatchspecError(
                "--branches needs a model proposer (eagle, draft, ngram+...): n-gram lookup has no ranking"
            )
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise BatchspecError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise BatchspecError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        for name in ("window_size", "min_group", "kv_budget_tokens", "prefill_chunk", "prefix_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise BatchspecError(f"{name} must be an integer >= 1, got {value!r}")
        if self.batch_invariant not in (None, True, False):
            raise BatchspecError(f"batch_invariant must be True, False or None, got {self.batch_invariant!r}")
        if self.window_size is not None and self.window_size < self.batch_size:
            raise BatchspecError(f"window_size ({self.window_size}) must be >= batch_size ({self.batch_size})")

    @property
    def window(self) -> int:
        return self.window_size if self.window_size is not None else 4 * self.batch_size

    @property
    def group_min(self) -> int:
        return min(self.min_group if self.min_group is not None else self.batch_size, self.batch_size)

    @property
    def k_max(self) -> int:
        """The most drafts a row verifies in one step (0 for a non-speculative method)."""
        if not self.speculative:
            return 0
        return AUTO_K_MAX if self.k == "auto" else self.k

    @property
    def speculative(self) -> bool:
        return methods.get(self.method).speculative
