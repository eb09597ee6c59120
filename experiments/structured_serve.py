"""Structured output on the default pair, as a serving user meets it, and what it costs.

1. A real `batchspec serve --pair default` (float32, defaults) and the official `openai` client:
   32 chat requests with JSON schemas (nested objects, arrays, enums, numbers, required fields;
   written as OpenAI's strict mode asks: no additional properties, arrays bounded),
   8 at a time, greedy. Every answer must parse, validate against its schema (`jsonschema`), and
   equal the same request through the offline masked `reference` (the target alone under the
   grammar's mask). Then the same 32 prompts at 1 and 8 at a time with and without the schema:
   completion tokens per second of wall time.
2. Offline, the same prompts in one ragged batch of 8 (the defaults), with jump-forward and with it
   turned off: tokens per step and forced tokens.

    python experiments/structured_serve.py [--json docs/bench/structured_serve.json]
    python experiments/structured_serve.py --extras [--json docs/bench/structured_extras.json]

3. (--extras) `response_format={"type": "json_object"}` and `tool_choice="required"` with two
   tools, 8 requests each, 8 at a time: every answer a JSON object; every answer a call whose
   arguments validate against the chosen tool's schema.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import jsonschema
import openai

from batchspec import SamplingParams, SpecDecoder, load_pair

TEXT = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "city": {
        "type": "object",
        "properties": {
            "name": TEXT,
            "country": TEXT,
            "population": {"type": "integer"},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
            "landmarks": {"type": "array", "items": TEXT, "maxItems": 3},
        },
        "required": ["name", "country", "population", "location", "landmarks"],
        "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "name": TEXT,
            "age": {"type": "integer"},
            "occupation": TEXT,
            "skills": {
                "type": "array",
                "items": {"enum": ["science", "art", "politics", "sport", "music"]},
                "maxItems": 3,
            },
            "alive": {"type": "boolean"},
        },
        "required": ["name", "age", "occupation", "skills", "alive"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": TEXT,
            "author": {
                "type": "object",
                "properties": {"first": TEXT, "last": TEXT},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer"},
            "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]}, "maxItems": 2},
            "rating": {"type": "number"},
        },
        "required": ["title", "author", "year", "genres", "rating"],
        "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {
            "dish": TEXT,
            "servings": {"type": "integer"},
            "difficulty": {"enum": ["easy", "medium", "hard"]},
            "ingredients": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"item": TEXT, "grams": {"type": "number"}},
                    "required": ["item", "grams"],
                    "additionalProperties": False,
                },
                "maxItems": 4,
            },
        },
        "required": ["dish", "servings", "difficulty", "ingredients"],
        "additionalProperties": False,
    },
}
SUBJECTS = {
    "city": ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo", "Sydney", "Toronto"],
    "person": [
        "Marie Curie",
        "Leonardo da Vinci",
        "Nelson Mandela",
        "Serena Williams",
        "Mozart",
        "Ada Lovelace",
        "Frida Kahlo",
        "Albert Einstein",
    ],
    "book": ["1984", "War and Peace", "The Odyssey", "Dune", "Hamlet", "Moby-Dick", "Beloved", "Emma"],
    "recipe": ["pancakes", "guacamole", "risotto", "tomato soup", "apple pie", "hummus", "fried rice", "omelette"],
}
MAX_TOKENS = 200


def requests() -> list[tuple[str, str]]:
    """(schema name, user message) x 32."""
    return [
        (kind, f"Describe {subject} as a JSON object with the fields {', '.join(SCHEMAS[kind]['required'])}.")
        for kind in SCHEMAS
        for subject in SUBJECTS[kind]
    ]


def start_server(port: int) -> tuple[subprocess.Popen, object]:
    log = tempfile.NamedTemporaryFile("w+", prefix="structured-serve-", suffix=".log")
    cmd = [
        sys.executable,
        "-m",
        "batchspec.cli",
        "serve",
        "--pair",
        "default",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not come up")


def _client(port: int) -> openai.AsyncOpenAI:
    """A client per event loop (asyncio.run closes the loop its connections live on)."""
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)


async def run_all(port: int, reqs, concurrency: int, constrained: bool) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)
    client = _client(port)

    async def one(kind, message):
        extra = {}
        if constrained:
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}}
        async with gate:
            return await client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": message}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                **extra,
            )

    start = time.perf_counter()
    async with client:
        out = await asyncio.gather(*(one(kind, message) for kind, message in reqs))
    return out, time.perf_counter() - start


def served(port: int, reqs) -> dict:
    results = {}
    for concurrency in (8, 1):
        for constrained in (True, False):
            outs, wall = asyncio.run(run_all(port, reqs, concurrency, constrained))
            tokens = sum(o.usage.completion_tokens for o in outs)
            steps = sum(o.model_extra["batchspec"]["steps"] for o in outs)
            key = f"C{concurrency}_{'schema' if constrained else 'free'}"
            results[key] = {
                "wall_s": round(wall, 2),
                "tokens": tokens,
                "tokens_per_s": round(tokens / wall, 2),
                "tokens_per_step": round(tokens / max(steps, 1), 3),
            }
            if constrained and concurrency == 8:
                results["answers"] = [
                    (o.choices[0].message.content, o.choices[0].finish_reason, o.model_extra["batchspec"]["token_ids"])
                    for o in outs
                ]
            print(key, results[key], flush=True)
    return results


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": TEXT, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount between currencies.",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "source": TEXT, "target": TEXT},
            "required": ["amount", "source", "target"],
            "additionalProperties": False,
        },
    },
}
TOOL_QUESTIONS = [
    "What's the weather in Paris right now?",
    "How many yen is 50 dollars?",
    "Is it raining in Lima?",
    "Convert 20 euros to pounds.",
    "Temperature in Oslo in fahrenheit?",
    "What are 100 francs in dollars?",
    "Should I take an umbrella in London today?",
    "How much is 7 pounds in euros?",
]
OBJECT_SUBJECTS = ("a cat", "the Moon", "a bicycle", "Python", "a sandwich", "Mars", "a violin", "a forest")
#: Open prompts (the model chooses the keys) and prompts that name them, as OpenAI's JSON mode asks
#: of a user ("instruct the model to produce JSON"): a 135M model free to choose keys rarely stops.
OBJECT_QUESTIONS = {
    "open": [f"Describe {s} as a JSON object." for s in OBJECT_SUBJECTS],
    "keys named": [f'Describe {s} as a JSON object with the keys "name", "color" and "size".' for s in OBJECT_SUBJECTS],
}


def extras(port: int) -> dict:
    """json_object: every answer is a JSON object (each prompt set apart); tool_choice=required with
    two tools: every answer carries a call whose arguments validate against the chosen tool's schema
    (8 each, 8 at a time)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CONVERT)}

    async def ask_all(requests):  # a client per asyncio.run
        client = _client(port)
        return await asyncio.gather(
            *(
                client.chat.completions.create(model="default", max_tokens=MAX_TOKENS, temperature=0, **kw)
                for kw in requests
            )
        )

    def objects(questions):
        return ask_all(
            [
                {"messages": [{"role": "user", "content": q}], "response_format": {"type": "json_object"}}
                for q in questions
            ]
        )

    def calls():
        return ask_all(
            [
                {"messages": [{"role": "user", "content": q}], "tools": [WEATHER, CONVERT], "tool_choice": "required"}
                for q in TOOL_QUESTIONS
            ]
        )

    out = {"json_object": {}}
    for name, questions in OBJECT_QUESTIONS.items():
        answers = asyncio.run(objects(questions))
        out["json_object"][name] = {
            "requests": len(answers),
            "json_objects": sum(_is_object(o.choices[0].message.content) for o in answers),
            "finish_reasons": [o.choices[0].finish_reason for o in answers],
            "answers": [o.choices[0].message.content for o in answers],
        }
    valid, made, answers = 0, [], asyncio.run(calls())
    for o in answers:
        for c in (o.choices[0].message.tool_calls or [])[:1]:
            made.append({"name": c.function.name, "arguments": c.function.arguments})
            try:
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    out["tools_required"] = {
        "requests": len(answers),
        "valid_calls": valid,
        "calls": made,
        "finish_reasons": [o.choices[0].finish_reason for o in answers],
    }
    print(json.dumps(out)[:2000], flush=True)
    return out


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def check(pair, reqs, answers) -> dict:
    """Every answer parses, validates and equals the offline masked reference."""
    ref = SpecDecoder(pair, method="reference")
    valid = equal = 0
    failures = []
    for i, ((kind, message), (text, finish, ids)) in enumerate(zip(reqs, answers)):
        want = ref.generate([message], SamplingParams(max_new_tokens=MAX_TOKENS, json_schema=SCHEMAS[kind]))[0]
        equal += want.token_ids == ids
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[kind])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as err:
            failures.append({"request": i, "finish_reason": finish, "error": str(err)[:200]})
    return {"requests": len(reqs), "valid": valid, "equal_to_reference": equal, "failures": failures}


def offline(pair, reqs) -> dict:
    """The same requests offline in one ragged batch of 8, with jump-forward and without, two
    rounds in alternating order; the tokens must be the same."""
    import batchspec.engine.step as step

    out = {"jump_forward": [], "no_jump_forward": []}
    original = step.forced_drafts
    params = [SamplingParams(max_new_tokens=MAX_TOKENS, json_schema=SCHEMAS[kind]) for kind, _ in reqs]
    tokens = []
    for jump in (True, False, False, True):
        step.forced_drafts = original if jump else _no_jump
        dec = SpecDecoder(pair, method="ragged", batch_size=8)
        tokens.append([o.token_ids for o in dec.generate([m for _, m in reqs], params)])
        s = dec.stats.summary()
        keys = ("tokens", "tokens_per_s", "mean_tokens_per_step", "mean_accepted", "forced_tokens")
        out["jump_forward" if jump else "no_jump_forward"].append(
            {key: round(s[key], 3) if isinstance(s[key], float) else s[key] for key in keys}
        )
        print(out, flush=True)
    step.forced_drafts = original
    out["same_tokens"] = all(t == tokens[0] for t in tokens)
    return out


def _no_jump(ctx, seqs, drafts, limit, proposal):
    return drafts, limit, proposal, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--extras", action="store_true", help="only the json_object and tool-call checks")
    args = parser.parse_args()
    reqs = requests()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, log = start_server(port)
    try:
        results = extras(port) if args.extras else served(port, reqs)
    finally:
        proc.terminate()
        proc.wait(60)
    if args.extras:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"max_tokens": MAX_TOKENS, "tools": [WEATHER, CONVERT], **results}, f, indent=1)
        return
    pair = load_pair("default")
    results["check"] = check(pair, reqs, results.pop("answers"))
    print(results["check"], flush=True)
    results["offline_B8"] = offline(pair, reqs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": MAX_TOKENS, "schemas": SCHEMAS, **results}, f, indent=1)


if __name__ == "__main__":
    main()
