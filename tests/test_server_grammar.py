"""Structured output through the server, as users run it: a real `batchspec serve` process, the
official `openai` client, concurrent requests mixing schemas, regexes and free rows, greedy and
seeded. Each answer equals the offline masked reference, follows its schema, and bad schemas or
grammars are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import random_prompts
from test_grammar import SCHEMA
from test_server import Server, _ids

from batchspec import SamplingParams, SpecDecoder, tiny_pair


@pytest.fixture(scope="module")
def server():
    srv = Server("--batch-size", "8", "-k", "3")
    yield srv
    assert srv.stop() == 0


def _client(server) -> openai.AsyncOpenAI:
    """A client of its own per event loop (asyncio.run closes the loop a client's connections live on)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _reference(prompt, params: SamplingParams) -> list[int]:
    pair = _REF.setdefault("pair", tiny_pair(dtype=torch.float64))
    return SpecDecoder(pair, method="reference").generate([prompt], params)[0].token_ids


_REF: dict = {}

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


def _kind(i: int) -> tuple[dict, dict]:
    """(request fields, SamplingParams keywords) of request i: a schema, a regex, JSON objects, free."""
    sampled = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {"temperature": 0}
    kinds = [
        ({"response_format": SCHEMA_FORMAT}, {"json_schema": SCHEMA}),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,9}"}}, {"regex": "[0-9]{3}-[a-z]{2,9}"}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
        ({}, {}),
    ]
    body, params = kinds[i % 4]
    return {**body, **sampled}, {**params, **sampled}


def test_concurrent_constrained_requests_equal_the_masked_reference(server):
    prompts = random_prompts(61, 24, 2, 30)

    async def one(client, i):
        body, _ = _kind(i)
        fields = {k: v for k, v in body.items() if k in ("temperature", "seed")}
        extra = {k: v for k, v in body.items() if k not in fields}
        out = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=48, extra_body=extra, **fields
        )
        return out.choices[0], _ids(out)

    async def all_of_them():
        async with _client(server) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    ended = 0
    for i, (choice, ids) in enumerate(asyncio.run(all_of_them())):
        _, params = _kind(i)
        assert ids == _reference(prompts[i], SamplingParams(max_new_tokens=48, **params)), f"request {i}"
        if choice.finish_reason == "stop" and i % 4 in (0, 2):
            ended += 1
            value = json.loads(choice.text)
            jsonschema.validate(value, SCHEMA if i % 4 == 0 else {"type": "object"})
    assert ended >= 1


def test_chat_with_a_schema_streams_what_it_answers_whole(server):
    messages = [{"role": "user", "content": "An item, please."}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 60, "temperature": 0, "response_format": SCHEMA_FORMAT}
    full = server.client.chat.completions.create(**kw)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in server.client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert streamed == full.choices[0].message.content
    assert full.choices[0].message.content.startswith('{"id": ')


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            ["strin"],
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "odd"}},
                }
            },
            "response_format.json_schema.schema",
            ["format"],
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema",
            ["name"],
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", ["unclosed group"]),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar", ["nothing"]),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", ["one of"]),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs", ["choice"]),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            ["not both"],
        ),
        ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos", ["ignore_eos"]),
    ],
)
def test_bad_schemas_and_grammars_are_400s_naming_the_field(server, extra, param, words):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, **extra}, timeout=20)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, response.text
    assert all(w in error["message"] for w in words), error["message"]


# --- tools ------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def _tool_reference(messages, choice, max_tokens: int) -> list[int]:
    from batchspec.serving import tools as tools_api
    from batchspec.serving.server import chat_ids

    pair = _REF.setdefault("pair", tiny_pair(dtype=torch.float64))
    tools = tools_api.parse({"tools": [WEATHER, ADD], "tool_choice": choice})
    ids = chat_ids(pair.tokenizer, messages, tools)
    params = SamplingParams(max_new_tokens=max_tokens, grammar=tools.grammar())
    return SpecDecoder(pair, method="reference").generate([ids], params)[0].token_ids


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_tool_choice_answer_calls_that_follow_the_schema(server, choice):
    questions = [f"Question {i}: {'weather in Oslo?' if i % 2 else 'what is 2 + 3?'}" for i in range(8)]

    async def one(client, q):
        return await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": q}],
            tools=[WEATHER, ADD],
            tool_choice=choice,
            max_tokens=120,
            temperature=0,
        )

    async def all_of_them():
        async with _client(server) as client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    for q, out in zip(questions, asyncio.run(all_of_them())):
        choice_out = out.choices[0]
        assert choice_out.finish_reason == "tool_calls", choice_out
        (call,) = choice_out.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert choice == "required" or call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        messages = [{"role": "user", "content": q}]
        assert _ids(out) == _tool_reference(messages, choice, 120)


def test_a_streamed_tool_call_equals_the_whole_answer(server):
    kw = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [WEATHER, ADD],
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
    }
    whole = server.client.chat.completions.create(**kw).choices[0]
    calls, finish, content = [], None, ""
    for c in server.client.chat.completions.create(stream=True, **kw):
        if c.choices:
            calls += c.choices[0].delta.tool_calls or []
            content += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0].function.name == whole.message.tool_calls[0].function.name
    assert calls[0].function.arguments == whole.message.tool_calls[0].function.arguments


def test_a_history_with_calls_and_results_is_served(server):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    ]
    out = server.client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def test_calls_are_split_from_the_text_and_streamed_whole():
    from batchspec.serving import tools as tools_api

    tools = tools_api.parse({"tools": [WEATHER, ADD]})
    text = 'Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = tools.split(text + "<tool_call>not json</tool_call>")
    assert content == "Let me see. <tool_call>not json</tool_call>" and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert tools.split("no calls <tool_call>") == ("no calls <tool_call>", [])
    stream = tools_api.Stream(tools)
    sent = "".join(stream.feed(piece) for piece in [text[:10], text[10:14], text[14:40], text[40:]])
    assert sent == "Let me see. "
    assert stream.finish()[1][0]["function"]["name"] == "add"
    plain = tools_api.Stream(tools)
    assert plain.feed("a <tool") == "a " and plain.feed("s are fine") == "<tools are fine"
    assert plain.finish() == (None, [])


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            ["nope"],
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", ["letters"]),
        ({"tools": [WEATHER, WEATHER]}, "tools", ["distinct"]),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls", ["required"]),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            ["remove"],
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
            ["strin"],
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(server, extra, param, words):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, response.text
    assert all(w in error["message"] for w in words), error["message"]
