"""Structured output through the server, as users run it: a real `batchspec serve` process, the
official `openai` client, concurrent requests mixing schemas, regexes and free rows, greedy and
seeded. Each answer equals the offline masked reference, follows its schema, and bad schemas or
grammars are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
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

    async def one(i):
        body, _ = _kind(i)
        fields = {k: v for k, v in body.items() if k in ("temperature", "seed")}
        extra = {k: v for k, v in body.items() if k not in fields}
        out = await server.aclient.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=48, extra_body=extra, **fields
        )
        return out.choices[0], _ids(out)

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(24)))

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
