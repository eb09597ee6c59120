"""The OpenAI wire format, as pure functions: request bodies -> validated `Job`s, engine output ->
response bodies and stream chunks. No HTTP and no engine here (server.py joins them).

Validation names the offending field (`BadRequest.param`) and says what was expected, so a
client gets OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.
Bounds: at most `MAX_STOP` stop strings of `MAX_STOP_CHARS` characters, `MAX_MESSAGES` messages
per chat, `MAX_PROMPTS` choices (prompts x `n`). No field is ignored: a request may carry the fields served
(`SERVED`), bookkeeping that changes no output (`NO_EFFECT`: `user`, `metadata`, `store`,
`service_tier`), and the fields of `UNSERVED` (`logit_bias`, `echo`, penalties, `tools`, ...)
only at their neutral values; anything else gets a 400 naming the field.
Structured output: `response_format` (`text`, `json_object`, `json_schema`) and the extension
`structured_outputs` (one of `json`, `regex`, `grammar` (Lark), as vLLM names them) constrain a
choice's output (core/grammar.py); a schema or grammar the engine cannot compile is a 400 naming it.
Extensions: `top_k` and `ignore_eos` in requests (as vLLM); `"batchspec": {"token_ids", "steps", "accepted_drafts",
"proposed_drafts"}` in responses (per chunk: the chunk's `token_ids`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..core.config import SamplingParams
from ..core.errors import BatchspecError
from ..core.logprobs import MAX_LOGPROBS
from . import tools as tools_api

#: Stop strings per request (OpenAI's limit) and characters per stop string (streaming holds back
#: that many characters at the end of the text, in case a stop string begins there).
MAX_STOP, MAX_STOP_CHARS = 4, 256
#: Messages per chat request.
MAX_MESSAGES = 1024
#: Choices per request (prompts x n; each one a row of the batch), and n per prompt.
MAX_PROMPTS, MAX_N = 64, 16
#: top_k at or beyond the vocabulary is off; larger values are stored as this.
TOP_K_CAP = 2**31 - 1
#: Fields this server does not serve -> their values that change nothing (absent or null too).
UNSERVED = {
    "logit_bias": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "functions": ([],),
}
#: Fields served, by endpoint (chat: True).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "n"}
_COMMON |= {"stream", "stream_options", "logprobs", "response_format", "structured_outputs"}
_TOOLS = {"tools", "tool_choice", "parallel_tool_calls"}
SERVED = {True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | _TOOLS, False: _COMMON | {"prompt"}}
#: Bookkeeping fields that change nothing a server returns (accepted, not stored).
NO_EFFECT = {"user", "metadata", "store", "service_tier"}


class BadRequest(BatchspecError):
    """A request the server refuses (status 400 unless told otherwise)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One validated request. `prompts`: one prompt per choice, each text or token ids
    (completions, up to MAX_PROMPTS) or messages (chat, one)."""

    chat: bool
    prompts: list
    max_tokens: int | None  # None: the endpoint's default (see server.py)
    params: SamplingParams  # max_new_tokens filled in by the server once the prompt is encoded
    stream: bool
    include_usage: bool
    model: str | None
    n: int = 1  # choices per prompt: choice j of prompt i has index i * n + j and seed `seed + j`
    constraint_field: str | None = None  # the field that gave params' grammar (errors name it)
    tools: tools_api.Tools | None = None  # chat: the tools offered, and how they may be called

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs is not None


def _get(body: dict, name: str, kinds: tuple, default=None, what: str = ""):
    """body[name] if present and not null, checked against `kinds` (bool is never a number)."""
    value = body.get(name)
    if value is None:
        return default
    numeric = int in kinds or float in kinds
    if not isinstance(value, kinds) or (numeric and isinstance(value, bool) and bool not in kinds):
        what = what or " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"'{name}' must be {what}, got {_brief(value)}", name)
    return value


def parse_job(body, chat: bool) -> Job:
    """Validate a /v1/completions (chat=False) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unserved(body, chat)
    prompts = [_parse_messages(body)] if chat else _parse_prompts(body)
    n = _get(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    if n * len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"{len(prompts)} prompts x n = {n} would make more than {MAX_PROMPTS} choices", "n")
    max_tokens = _get(
        body,
        "max_completion_tokens" if chat and "max_tokens" not in body else "max_tokens",
        (int,),
        None,
        "an integer >= 1",
    )
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be an integer >= 1, got {max_tokens}", "max_tokens")
    constraint, where = _parse_constraint(body)
    tools = _parse_tools(body) if chat else None
    if tools is not None and tools.forced:  # one call of an allowed tool: a grammar
        if constraint:
            raise BadRequest(f"'tool_choice' {tools.choice!r} constrains the output: remove '{where}'", "tool_choice")
        constraint, where = {"grammar": tools.grammar()}, "tools"
    params = _parse_sampling(body, chat, constraint, where)
    stream = _get(body, "stream", (bool,), False, "a boolean")
    options = _get(body, "stream_options", (dict,), {}, "an object")
    include_usage = _get(options, "include_usage", (bool,), False, "a boolean")
    model = _get(body, "model", (str,), None, "a string")
    return Job(chat, prompts, max_tokens, params, stream, include_usage, model, n, where, tools)


def _parse_tools(body: dict) -> tools_api.Tools | None:
    try:
        return tools_api.parse(body)
    except tools_api.ToolError as err:
        raise BadRequest(str(err), err.param) from None


def _refuse_unserved(body: dict, chat: bool) -> None:
    """A 400 naming the first field set to a value this server would not honour, or unknown."""
    for name in body:
        if name not in SERVED[chat] and name not in NO_EFFECT and name not in UNSERVED:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise BadRequest(f"'{name}' is not a field {endpoint} serves; remove it from the request", name)
    for name, neutral in UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise BadRequest(f"'{name}' is not supported by this server; remove it from the request", name)


def _same(value, neutral) -> bool:
    """value == neutral, where a boolean equals only a boolean (0 == 0.0, but not False)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _brief(value) -> str:
    """repr(value), cut to 100 characters (an error message need not echo a whole body)."""
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token, or None (no logprobs): chat's `logprobs` (a boolean) and
    `top_logprobs`; completions' `logprobs` (an integer)."""
    if not chat:
        top = _get(body, "logprobs", (int,), None, f"an integer in [0, {MAX_LOGPROBS}]")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise BadRequest(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "logprobs")
        return top
    wanted = _get(body, "logprobs", (bool,), False, "a boolean")
    top = _get(body, "top_logprobs", (int,), None, f"an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if top and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _parse_sampling(body: dict, chat: bool, constraint: dict, where: str | None) -> SamplingParams:
    temperature = _get(body, "temperature", (int, float), 1.0, "a number in [0, 2]")
    if not 0 <= temperature <= 2:
        raise BadRequest(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = _get(body, "top_p", (int, float), 1.0, "a number in (0, 1]")
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", (int,), 0, "an integer (0 or -1: off)")
    if top_k < -1:
        raise BadRequest(f"'top_k' must be >= -1 (0 or -1: off), got {top_k}", "top_k")
    seed = _get(body, "seed", (int,), None, "an integer")
    stop = _get(body, "stop", (str, list), (), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP:
        raise BadRequest(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of them, got {_brief(stop)}", "stop")
    if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
        raise BadRequest(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}", "stop")
    ignore_eos = _get(body, "ignore_eos", (bool,), False, "a boolean")
    logprobs = _parse_logprobs(body, chat)
    try:
        return SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=min(max(top_k, 0), TOP_K_CAP),
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            **constraint,
        )
    except BatchspecError as err:  # only the constraint is left unchecked here
        raise BadRequest(str(err), "ignore_eos" if "ignore_eos" in str(err) else where) from None


#: `structured_outputs` keys -> SamplingParams fields.
STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}


def _parse_constraint(body: dict) -> tuple[dict, str | None]:
    """(SamplingParams keywords of the request's constraint, the field that gave it): from
    `response_format` or `structured_outputs`, at most one of them."""
    fmt = _get(body, "response_format", (dict,), {"type": "text"}, "an object")
    ext = _get(body, "structured_outputs", (dict,), {}, "an object")
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        what = "'text', 'json_object' or 'json_schema'"
        raise BadRequest(f"'response_format.type' must be {what}, got {_brief(kind)}", "response_format")
    if kind != "text" and ext:
        raise BadRequest("give either 'response_format' or 'structured_outputs', not both", "structured_outputs")
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}, "response_format"
    if kind == "json_schema":
        spec = _get(fmt, "json_schema", (dict,), None, "an object")
        if spec is None or not isinstance(spec.get("name"), str):
            raise BadRequest("'response_format.json_schema' needs a 'name' (a string)", "response_format.json_schema")
        _get(spec, "strict", (bool,), False, "a boolean")  # checked; the schema is always enforced
        schema = _get(spec, "schema", (dict,), {}, "an object")
        return {"json_schema": schema}, "response_format.json_schema.schema"
    unknown = sorted(set(ext) - set(STRUCTURED))
    if unknown:
        raise BadRequest(
            f"'structured_outputs' has no field '{unknown[0]}' (known: json, regex, grammar)", "structured_outputs"
        )
    given = {STRUCTURED[key]: value for key, value in ext.items() if value is not None}
    if len(given) > 1:
        raise BadRequest("'structured_outputs' takes one of json, regex and grammar", "structured_outputs")
    where = next((f"structured_outputs.{key}" for key in ext if ext[key] is not None), None)
    return given, where


def _parse_prompts(body: dict) -> list:
    """`prompt`: a string, a list of token ids, or a list of either (a batch: one choice each)."""
    prompt = body.get("prompt")
    if _one_prompt(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
        for i, p in enumerate(prompt):
            if not _one_prompt(p):
                raise BadRequest(
                    f"'prompt[{i}]' must be a non-empty string or a list of token ids, got {_brief(p)}", f"prompt[{i}]"
                )
        return prompt
    raise BadRequest(
        "'prompt' must be a non-empty string, a list of token ids, or a list of those (one choice each), "
        f"got {_brief(prompt)}",
        "prompt",
    )


def _one_prompt(prompt) -> bool:
    """A non-empty string or a non-empty list of token ids."""
    if isinstance(prompt, str):
        return bool(prompt)
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    return ids and bool(prompt)


def _parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'messages' must be a non-empty list of messages, got {_brief(messages)}", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' may hold at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}].role")
        calls = _tool_calls(m, i)
        content = None if calls and m.get("content") is None else _content(m.get("content"), i)
        message = {"role": m["role"], "content": content} | ({"tool_calls": calls} if calls else {})
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(message: dict, i: int) -> list[dict] | None:
    """An assistant message's earlier `tool_calls`, checked: [{id, type, function: {name, arguments}}]."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    ok = isinstance(calls, list) and message.get("role") == "assistant"
    for c in calls if ok else ():
        f = c.get("function") if isinstance(c, dict) else None
        ok = ok and isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)
    if not ok:
        raise BadRequest(
            f"'{where}' must be an assistant's list of {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
            where,
        )
    return [{"id": c.get("id", ""), "type": "function", "function": dict(c["function"])} for c in calls]


def _content(content, i: int) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts", f"messages[{i}].content")


# --- responses --------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_body(chat: bool, entries: list, token_bytes, offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice (or of a chunk's tokens) from logprobs.TokenLogprob entries;
    `token_bytes(id)` is the token's bytes. Chat: `content`, one object per token with its
    `top_logprobs`; completions: `tokens`, `token_logprobs`, `top_logprobs` (token text ->
    logprob, the likelier where two read the same) and `text_offset` (characters before each
    token, from `offset`)."""

    def text(token: int) -> str:
        return token_bytes(token).decode("utf-8", errors="replace")

    def item(token: int, logprob: float) -> dict:
        return {"token": text(token), "logprob": logprob, "bytes": list(token_bytes(token))}

    if chat:
        content = [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(text(e.token))
    return {
        "tokens": [text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_first_by_text(e.top, text) for e in entries],
        "text_offset": offsets,
    }


def _first_by_text(top: tuple, text) -> dict:
    """{token text: logprob} of (id, logprob) pairs, most likely first; where two tokens read the
    same (e.g. both part of a character), the likelier one's."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(text(token), logprob)
    return out


def response(job: Job, rid: str, model: str, outputs: list[tuple], use: dict) -> dict:
    """The non-streamed body of a completion or chat completion; `outputs`: (text, finish reason,
    extension, logprobs body or None) per choice, in prompt order. The top-level `batchspec` extension is choice 0's;
    with several choices each one carries its own too."""
    choices = []
    for index, (text, finish, extension, logprobs) in enumerate(outputs):
        if job.chat:
            content, calls = job.tools.split(text) if job.tools is not None and job.tools.calls else (text, [])
            choice = {"index": index, "message": {"role": "assistant", "content": content}}
            if calls:
                choice["message"]["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        if len(outputs) > 1:
            choice["batchspec"] = extension
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
        "batchspec": outputs[0][2],
    }


def chunk(
    job: Job,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None,
    extension: dict | None = None,
    role: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
    calls: list[dict] | None = None,
) -> dict:
    """One stream chunk carrying choice `index`'s `text` (chat: a delta; `role` adds the
    assistant role; `calls`: its tool calls, whole) and the `logprobs` body of its tokens."""
    if job.chat:
        delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if job.include_usage:
        body["usage"] = None
    if extension is not None:
        body["batchspec"] = extension
    return body


def usage_chunk(job: Job, rid: str, model: str, use: dict, extension: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
        "batchspec": extension,
    }
