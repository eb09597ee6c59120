"""`Sequence`: one request's tokens, the single source of truth; and `GenerationOutput`.

Every tensor the engine builds (ids, masks, positions) is a view derived from `token_ids`; the
caches hold keys/values for a prefix of it. `commit` is the only way tokens are added, and it is
where per-row stopping (EOS inside an accepted run, `max_new_tokens`, the context) happens, and
where a constrained row's grammar state advances.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .config import SamplingParams
from .grammar import Matcher
from .sampling import request_seed


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. `token_ids` = prompt + generated; it never holds a token after a stop."""

    index: int  # position in the caller's input list; results come back in this order
    prompt_ids: list[int]
    max_len: int  # hard cap on len(token_ids): min(prompt + max_new_tokens, context)
    eos_ids: frozenset[int]
    seed: int | None = None  # sampled rows: the seed their token noise is keyed by; None when greedy
    params: SamplingParams = field(default_factory=SamplingParams)  # this row's sampling
    token_ids: list[int] = field(init=False)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (EOS, stop string), "length" or "abort" (cancelled)
    accepted_per_step: list[int] = field(default_factory=list)  # draft tokens kept, per spec step
    proposed_drafts: int = 0  # draft tokens offered to this row, all steps together
    cancelled: bool = False  # set by any thread; the engine retires the row before its next step
    output_len: int | None = None  # set when a stop string cuts the output short of token_ids
    noise: dict = field(default_factory=dict)  # sampling: Gumbel noise of uncommitted positions
    logprobs: list | None = field(init=False)  # one TokenLogprob per generated token, if params ask
    matcher: Matcher | None = None  # the grammar's state (params' json_schema/regex/grammar): committed tokens only

    @classmethod
    def request(
        cls,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        context: int,
        eos_ids: frozenset[int],
        matcher: Matcher | None = None,
    ) -> Sequence:
        """The sequence of one request (the one place a request becomes a Sequence): at most
        `params.max_new_tokens` new tokens within the model's `context`, no EOS ids when the request
        ignores EOS, a sampled row's noise keyed by the request's seed (a fresh one when it has none),
        and `matcher` (grammar.Compiler.matcher) when the request constrains its output."""
        if (params.constraint is None) != (matcher is None):
            raise ValueError("a request with a grammar needs its matcher, and only such a request has one")
        return cls(
            index=index,
            prompt_ids=list(prompt_ids),
            max_len=min(len(prompt_ids) + params.max_new_tokens, context),
            eos_ids=frozenset() if params.ignore_eos else eos_ids,
            seed=None if params.greedy else request_seed(params.seed),
            params=params,
            matcher=matcher,
        )

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.logprobs = [] if self.params.logprobs is not None else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len : self.output_len]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def commit(self, tokens: list[int], num_accepted: int | None = None) -> int:
        """Append `tokens` up to and including the first EOS, and never beyond `max_len`.

        `num_accepted`: how many leading tokens were accepted drafts (None for a non-speculative
        token, e.g. the one from prefill); the kept share of them is recorded per step.
        Returns how many tokens were kept.
        """
        assert not self.finished, f"sequence {self.index} is finished; nothing may be appended"
        kept = 0
        for token in tokens:
            self.token_ids.append(token)
            kept += 1
            if token in self.eos_ids:
                self._finish("stop")
                break
            if len(self.token_ids) >= self.max_len:
                self._finish("length")
                break
        if self.matcher is not None:
            self.matcher.advance(tokens[:kept])
        if num_accepted is not None:
            self.accepted_per_step.append(min(num_accepted, kept))
        return kept

    def finish(self, reason: str, generated: int | None = None) -> None:
        """Stop the sequence (a stop string, a cancellation); the engine retires its row.
        `generated`: keep only that many generated tokens in the output (a stop string ended
        there); the rest of the step stays in `token_ids`, which the batch layout has counted."""
        if generated is not None:
            self.output_len = self.prompt_len + generated
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason


@dataclass
class GenerationOutput:
    """What `SpecDecoder.generate` returns for one prompt (in input order)."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only (an EOS that stopped the row is included)
    text: str
    finish_reason: str
    accepted_per_step: list[int]
    logprobs: list | None = None  # one logprobs.TokenLogprob per token of token_ids, when asked

    def to_json(self) -> dict:
        logprobs = None if self.logprobs is None else [entry.to_json() for entry in self.logprobs]
        return {
            "index": self.index,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_generated_tokens": len(self.token_ids),
            "accepted_per_step": self.accepted_per_step,
        } | ({} if logprobs is None else {"logprobs": logprobs})
