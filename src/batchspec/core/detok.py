"""The output processor: incremental detokenisation and stop strings, one request at a time.

`Detokenizer` turns a growing list of token ids into text deltas. A delta is released only when
the decoded text does not end in U+FFFD, so a multi-byte UTF-8 character split over tokens (or
over the tokens of several steps) is released whole; a window of recent tokens (`prefix`) is
re-decoded with the new ones so tokenizers that drop or merge leading spaces decode the same as
the whole. At the end, `flush` releases whatever is held. Invariant: the concatenated deltas equal
`tokenizer.decode(all tokens)` whenever decoding is concatenative at character boundaries (true
for byte-level BPE tokenizers such as the tiny pair's and SmolLM2's).

`TextOutput` feeds tokens one at a time, finds stop strings (the text ends right before the first
one to appear, and the token that completed it is the last one counted), and withholds the last
`len(longest stop) - 1` characters while running, so streamed text never shows a stop string's
beginning that the final text drops: streamed == final text.
"""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> character table

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental decoding of one sequence's generated tokens."""

    def __init__(self, decode):
        self.decode = decode  # list[int] -> str (special tokens skipped)
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] decoded to text already released
        self.read = 0

    def add(self, token: int) -> str:
        """Append one token; returns the newly complete text ('' while a character is split)."""
        self.tokens.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """Release any held text (an incomplete character decodes to U+FFFD, as in `decode`)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self.decode(self.tokens[self.prefix : self.read])
        text = self.decode(self.tokens[self.prefix :])
        if len(text) <= len(before) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(before) :]


class TextOutput:
    """One request's text so far: detokenised, cut at stop strings, released for streaming."""

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.detok = Detokenizer(decode)
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars withheld while running
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` released by `take`
        self.num_tokens = 0  # tokens counted in the output
        self.stopped = False  # a stop string was found

    def feed(self, tokens: list[int]) -> bool:
        """Add generated tokens in order; True when a stop string ended inside them (the tokens
        after the one that completed it are not counted, and `text` ends before the stop string)."""
        for token in tokens:
            if self.stopped:
                break
            self.num_tokens += 1
            self._extend(self.detok.add(token))
        return self.stopped

    def finish(self) -> None:
        """No more tokens: release held text (unless a stop string already ended the text)."""
        if not self.stopped:
            self._extend(self.detok.flush())

    def take(self, final: bool = False) -> str:
        """Text not yet released: all of it when `final` or stopped, else all but the held tail."""
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _extend(self, delta: str) -> None:
        if not delta:
            return
        start = max(0, len(self.text) - self.hold)  # a stop string may begin in the held tail
        self.text += delta
        cut = find_stop(self.text, self.stop, start)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Index in `text` where the earliest-ending stop string begins (searching from `start`), or None."""
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop, start)) >= 0]
    return min(found)[1] if found else None


class StopStrings:
    """The offline output processor: a `TextOutput` per sequence that has stop strings; a row
    whose text reaches one is finished ("stop") with its output cut there."""

    def __init__(self, decode, seqs):
        self.outputs = {id(s): TextOutput(decode, s.params.stop) for s in seqs if s.params.stop}
        self.active = bool(self.outputs)

    def observe(self, seqs) -> None:
        """Step hook: feed each watched row its new tokens; finish rows that hit a stop string."""
        for seq in seqs:
            out = self.outputs.get(id(seq))
            if out is None or out.stopped:
                continue
            new = seq.token_ids[seq.prompt_len + out.num_tokens :]
            if out.feed(new):
                seq.finish("stop", generated=out.num_tokens)
            elif seq.finished:
                out.finish()

    def text(self, seq) -> str | None:
        """The cut text of a watched sequence, else None (decode the tokens)."""
        out = self.outputs.get(id(seq))
        return None if out is None else out.text


class TokenBytes:
    """token id -> the UTF-8 bytes it stands for (memoised), as OpenAI's logprobs report them:
    exact for byte-level BPE (a token holding part of a character has that part's bytes), else the
    bytes of the token decoded alone. `text(id)`: those bytes as text (a partial character: U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.memo: dict[int, bytes] = {}
        self.byte_of = _byte_level_map(tokenizer)

    def __call__(self, token: int) -> bytes:
        if (found := self.memo.get(token)) is None:
            piece = self.tokenizer.convert_ids_to_tokens(token) if self.byte_of else None
            if piece is not None and all(c in self.byte_of for c in piece):
                found = bytes(self.byte_of[c] for c in piece)
            else:
                found = self.tokenizer.decode([token]).encode()
            self.memo[token] = found
        return found

    def text(self, token: int) -> str:
        return self(token).decode("utf-8", errors="replace")


def _byte_level_map(tokenizer) -> dict[str, int] | None:
    """The byte-level BPE alphabet (character -> byte) when `tokenizer` decodes that way, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    return {c: b for b, c in bytes_to_unicode().items()}
