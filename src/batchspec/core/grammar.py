"""Constrained output: a request's grammar (a JSON schema, a regex or a Lark grammar), and the
tokens it allows at each position, through llguidance.

- `Grammar`: what a request constrains its output to; checked where it is written.
- `Compiler`: one per tokenizer. Compiles a grammar once (a bounded LRU of checked matchers,
  copied per request) and makes each request's `Matcher`.
- `Matcher`: a row's grammar state. Only committed tokens advance it (`Sequence.commit`). The
  masks of drafted positions are computed by consuming the drafts and rolling them back, so a
  rejected draft never moves it.
- `apply(logits, bits)`: the pure tensor function that turns disallowed tokens' logits to -inf.

The constrained target's pick at a position is its pick over the allowed tokens only (greedy:
the argmax of the masked logits; sampling: the Gumbel pick of the masked distribution), in
`reference` and in every method alike. EOS is allowed only where the grammar accepts the output.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .errors import BatchspecError

KINDS = ("json_schema", "regex", "grammar")
#: Compiled grammars kept per compiler (most recently used first out of the cache last).
CACHE_SIZE = 64
#: llguidance's bounds on one grammar's build and on each mask's work: a grammar past them is
#: refused with the limit it hit, instead of stalling the engine.
LIMITS = {"initial_lexer_fuel": 2_000_000, "step_lexer_fuel": 400_000, "max_grammar_size": 500_000}


#: How a JSON schema's output is laid out unless the schema's own "x-guidance" says otherwise: on one
#: line, ", " between items and ": " after keys. Bounded (free whitespace lets a model pad forever)
#: and more of it is forced, which jump-forward drafts for free.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """kind: "json_schema" (source: the schema as JSON text), "regex" or "grammar" (Lark text)."""

    kind: str
    source: str

    @classmethod
    def of(cls, kind: str, source) -> Grammar:
        """A checked Grammar; a JSON schema may be given as a dict or as JSON text."""
        if kind not in KINDS:
            raise BatchspecError(f"unknown grammar kind {kind!r}; choose one of {', '.join(KINDS)}")
        if kind == "json_schema":
            if isinstance(source, str):
                try:
                    source = json.loads(source)
                except json.JSONDecodeError as e:
                    raise BatchspecError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(source, (dict, bool)):
                raise BatchspecError(f"json_schema must be a JSON object, got {type(source).__name__}")
            return cls(kind, json.dumps(source))  # key order kept: it is the order of the output's keys
        if not isinstance(source, str) or not source:
            raise BatchspecError(f"{kind} must be a non-empty string, got {source!r}")
        return cls(kind, source)

    def llguidance(self) -> str:
        """This grammar in llguidance's own form."""
        import llguidance

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class Compiler:
    """Grammars compiled against one tokenizer, for a model whose logits have `vocab_size`
    columns and whose end-of-sequence ids are `eos_ids`. Thread-safe: the server compiles in the
    request's thread, off the engine loop."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = CACHE_SIZE):
        import llguidance
        import llguidance.hf

        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except ValueError as e:
            raise BatchspecError(f"constrained output needs a fast (Rust) Hugging Face tokenizer: {e}") from None
        self.vocab_size, self.eos_ids, self.cache_size = vocab_size, frozenset(eos_ids), cache_size
        self._limits = llguidance.LLParserLimits(**LIMITS)
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh Matcher of `grammar` (compiled once per grammar, then copied). A grammar that
        llguidance refuses raises BatchspecError naming the problem."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is None:
            template = self._compile(grammar)
            with self._lock:
                self._compiled[grammar] = template
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return Matcher(template, self.vocab_size, self.eos_ids)

    def _compile(self, grammar: Grammar):
        import llguidance

        try:
            text = grammar.llguidance()
        except ValueError as e:
            raise BatchspecError(f"invalid {grammar.kind}: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise BatchspecError(f"invalid {grammar.kind}: {matcher.get_error()}")
        return matcher


class Matcher:
    """One row's grammar state over a vocabulary of `vocab` ids. A speculative path never
    consumes an end-of-sequence id (`eos`): nothing follows it, and llguidance cannot roll one
    back once its grammar has stopped."""

    def __init__(self, start, vocab: int, eos: frozenset[int]):
        """start: the compiled grammar's unused llguidance matcher (copied, never changed)."""
        self._start, self._m, self.vocab, self.eos = start, start.deep_copy(), vocab, eos
        self.words = (vocab + 31) // 32
        self.tokens: list[int] = []  # what it has consumed: a row's committed tokens between steps

    def replayed(self) -> Matcher:
        """A fresh matcher of the same grammar fed `tokens` (the invariant checker compares it)."""
        fresh = Matcher(self._start, self.vocab, self.eos)
        fresh.advance(self.tokens)
        return fresh

    def advance(self, tokens: list[int]) -> None:
        """Consume committed tokens (every one was allowed: the masks chose them)."""
        for token in tokens:  # one by one: consume_tokens refuses EOS once the grammar has stopped
            if not self._m.consume_token(token):
                raise RuntimeError(f"a committed token left its grammar: {self._m.get_error()}")
            self.tokens.append(token)

    def valid(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here (nothing is consumed)."""
        return self._m.validate_tokens(tokens) if tokens else 0

    def walkable(self, chain: list[int]) -> list[int]:
        """The leading drafts of `chain` that `along` walks: up to the first one the grammar
        refuses or the first EOS (never consumed on a speculative path)."""
        stop = next((i for i, token in enumerate(chain) if token in self.eos), len(chain))
        # Cut here, not only by llguidance's walk: it also stops at a refused draft and where the
        # grammar stops, but `along`'s meaning should not rest on that.
        return chain[: self.valid(chain[:stop])]

    def mask(self) -> torch.Tensor:
        """[words] int32: bit t set where token t is allowed next."""
        out = torch.empty(self.words, dtype=torch.int32)
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), 4 * self.words)
        return out

    def along(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), words]: the mask after each path of tokens from here (a chain's prefixes,
        a tree's ancestries); all-allowed where the grammar refuses a path (its last token can
        never be kept: the pick before it is masked). The state is unchanged afterwards."""
        out = torch.full((len(paths), self.words), -1, dtype=torch.int32)
        held: list[int] = []  # the path consumed now: the next one rolls back only to their common prefix
        for i, path in enumerate(paths):
            common = next((j for j, (a, b) in enumerate(zip(held, path)) if a != b), min(len(held), len(path)))
            self.rollback(len(held) - common)
            held, rest = held[:common], path[common:]
            if self.valid(rest) == len(rest) and not self.eos.intersection(rest):
                self.advance(rest)
                held = list(path)
                out[i] = self.mask()
        self.rollback(len(held))
        return out

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens from here that are each the only one the grammar allows at its
        position (the fixed keys and punctuation of a schema): the constrained target picks them
        whatever its logits. The state is unchanged afterwards."""
        tokens: list[int] = []
        while len(tokens) < most:
            token = only(self.mask(), self.vocab)
            if token is None:
                break
            tokens.append(token)
            if tokens[-1] in self.eos:  # the end: kept, never consumed
                break
            self.advance(tokens[-1:])
        self.rollback(len(tokens) - (tokens[-1] in self.eos if tokens else 0))
        return tokens

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self._m.get_error()}")
        del self.tokens[len(self.tokens) - n :]


_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """bits [..., W] int32 -> bool [..., vocab]: token t is allowed."""
    unpacked = (bits[..., None] >> _SHIFTS.to(bits.device)) & 1  # [..., W, 32], bit t % 32 of word t // 32
    return unpacked.flatten(-2)[..., :vocab].bool()


def only(bits: torch.Tensor, vocab: int) -> int | None:
    """bits [W] int32 -> the one token allowed, or None where none or several are (`allowed`'s
    answer, read from the one non-zero word: a tenth of unpacking the vocabulary)."""
    words = bits.nonzero()
    if len(words) != 1:
        return None
    at = int(words[0, 0])
    word = int(bits[at]) & 0xFFFFFFFF
    token = 32 * at + word.bit_length() - 1
    return token if word & (word - 1) == 0 and token < vocab else None


def apply(logits: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """logits [..., V], bits [..., W] int32 (or None: no row constrained) -> logits with -inf at
    every disallowed token (a new tensor; all-ones words leave a row as it is)."""
    if bits is None:
        return logits
    return logits.masked_fill(~allowed(bits.to(logits.device), logits.shape[-1]), float("-inf"))


def chain_masks(seqs: list, chains: list[list[int]]) -> torch.Tensor | None:
    """Each row's masks before each of its drafts `chains[b]` and after the last -> [B, n, W]
    int32, n = 1 + the longest chain: `row_masks` of the chains' prefixes, in one llguidance call
    for the batch (its own threads; each matcher walks its chain and rolls it back). All-allowed
    for free rows, and from the first draft the grammar refuses or an EOS on (as `Matcher.along`);
    None when no row has a grammar."""
    n = 1 + max(map(len, chains))
    out = _all_allowed(seqs, n)
    if out is None:
        return None
    rows = [(b, seq.matcher, chain) for b, (seq, chain) in enumerate(zip(seqs, chains)) if seq.matcher is not None]
    walks = [(m._m, b * n, m.walkable(chain)) for b, m, chain in rows]
    # Row b's masks fill slots b * n .. b * n + len(walk) < (b + 1) n.
    args = (out.data_ptr(), 4 * out.shape[-1], len(seqs) * n)
    if any(walk for _, _, walk in walks):  # llguidance's call with drafts wants some for every row
        _executor().unsafe_compute_mask_ptr_with_draft_token([job for job in walks if job[2]], *args)
    if not all(walk for _, _, walk in walks):
        _executor().unsafe_compute_mask_ptr([(m, at) for m, at, walk in walks if not walk], *args)
    _raise_errors(m for m, _, _ in walks)
    return out


@functools.cache
def _executor():
    """llguidance's thread pool for batched masks (one per process; its default size)."""
    import llguidance

    return llguidance.LLExecutor()


def _raise_errors(matchers) -> None:
    """A batched call ends a row's walk where its grammar fails (a bound of LIMITS hit) without
    raising; raise it here, as a row's own calls would."""
    for m in matchers:
        if m.is_error():
            raise RuntimeError(f"grammar error: {m.get_error()}")


def row_masks(seqs: list, paths: list[list[list[int]]]) -> torch.Tensor | None:
    """Each row's masks after `paths[b]` (see Matcher.along) -> [B, n, W] int32, all-allowed for a
    free row; None when no row has a grammar."""
    out = _all_allowed(seqs, max(len(p) for p in paths))
    if out is None:
        return None
    for b, (seq, rows) in enumerate(zip(seqs, paths)):
        if seq.matcher is not None:
            out[b, : len(rows)] = seq.matcher.along(rows)
    return out


def _all_allowed(seqs: list, n: int) -> torch.Tensor | None:
    """[B, n, W] int32 of all-allowed masks, W the rows' grammars' words; None when no row has one."""
    first = next((seq.matcher for seq in seqs if seq.matcher is not None), None)
    return None if first is None else torch.full((len(seqs), n, first.words), -1, dtype=torch.int32)


def constrained(seqs: list) -> bool:
    return any(seq.matcher is not None for seq in seqs)


def masked(logits: torch.Tensor, bits: torch.Tensor, vocab: int, head_ids: torch.Tensor | None = None):
    """logits [..., V_head], bits [..., W] over a vocabulary of `vocab` ids (head_ids [V_head]: each
    column's full id; None: the full vocabulary) -> (logits with -inf at the tokens the bits refuse,
    empty [...]: where the head has none of the allowed tokens, left unmasked: verification cuts
    whatever is drafted there)."""
    ok = allowed(bits, vocab).to(logits.device)
    if head_ids is not None:
        ok = ok[..., head_ids.to(logits.device)]
    empty = ~ok.any(dim=-1)
    return logits.masked_fill(~ok & ~empty[..., None], float("-inf")), empty


class DraftGuide:
    """Masks a drafter's chain by the grammar: each constrained row's matcher advanced along that
    row's own drafts as they are picked, and rolled back by `close` (so the drafter's picks are
    allowed tokens, which the masked target keeps more often). A row whose allowed tokens the
    drafter's vocabulary lacks drafts unmasked from there (verification cuts it)."""

    def __init__(self, seqs: list):
        self.matchers = [seq.matcher for seq in seqs]
        self.alive = [m is not None for m in self.matchers]
        self.depth = [0] * len(seqs)

    def mask(self, logits: torch.Tensor, head_ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V_head] (head_ids [V_head]: each column's full id; None: the full vocabulary)."""
        if not any(self.alive):
            return logits
        words = next(m.words for m in self.matchers if m is not None)
        bits = torch.full((len(self.matchers), words), -1, dtype=torch.int32)
        jobs = [(m._m, b) for b, (m, alive) in enumerate(zip(self.matchers, self.alive)) if alive]
        _executor().unsafe_compute_mask_ptr(jobs, bits.data_ptr(), 4 * words, len(self.matchers))
        _raise_errors(m for m, _ in jobs)
        out, empty = masked(logits, bits, self.matchers[self.alive.index(True)].vocab, head_ids)
        for b in empty.nonzero().flatten().tolist():
            self.alive[b] = False
        return out

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [B]: the drafts just picked (full ids)."""
        for b, token in enumerate(tokens.tolist()):
            m = self.matchers[b]
            if self.alive[b] and token not in m.eos and m.valid([token]) == 1:
                m.advance([token])
                self.depth[b] += 1
            else:
                self.alive[b] = False

    def close(self) -> None:
        for m, depth in zip(self.matchers, self.depth):
            if m is not None:
                m.rollback(depth)
        self.depth = [0] * len(self.matchers)


class TreeGuide:
    """Masks a drafter's tree by the grammar: each fed node's logits by the mask after its own
    ancestry (`row_masks`: the matchers walk each path and roll it back, so the state is unchanged).
    A node whose path the grammar refuses (or ends at an EOS) drafts unmasked, as does one whose
    allowed tokens the drafter's vocabulary lacks: verification cuts what is drafted there."""

    def __init__(self, seqs: list):
        self.seqs = seqs
        self.vocab = next(seq.matcher.vocab for seq in seqs if seq.matcher is not None)
        self.paths: list[list[list[int]]] = [[[]] for _ in seqs]  # each row's fed nodes' paths: the root's

    def mask(self, logits: torch.Tensor, head_ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, m, V_head] of the m nodes fed last (their paths `paths`) -> masked."""
        return masked(logits, row_masks(self.seqs, self.paths), self.vocab, head_ids)[0]

    def grow(self, parent: torch.Tensor, tokens: torch.Tensor) -> None:
        """parent [B, c] (each new node's parent among the nodes fed last), tokens [B, c] (full ids):
        the next depth's nodes, fed next."""
        self.paths = [
            [paths[p] + [t] for p, t in zip(up, row)]
            for paths, up, row in zip(self.paths, parent.tolist(), tokens.tolist())
        ]
