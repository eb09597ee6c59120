"""`batchspec serve` end to end: a real server process on 127.0.0.1 (the tiny pair, float64 so
greedy rows can be compared with the reference exactly), called with the official `openai` client.
Prompts are token-id lists; outputs are compared by token ids (the `batchspec.token_ids`
extension), since the tiny model's random bytes are not valid UTF-8 text."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest
from helpers import NEEDS_ONEDNN_BF16, random_prompts, reference_tokens

from batchspec import BatchspecError

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, *options: str) -> tuple[list[str], dict]:
    """The command line and environment of `batchspec serve` for the tiny pair on `port`."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "batchspec.cli", "serve", "--pair", "tiny", "--dtype", "float64"]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port), *options], env


class Server:
    def __init__(self, *options: str, ready: str | None = None, ready_s: float = 60):
        """Start `batchspec serve` with `options`; up once /health answers (and, if `ready` is
        given, once the log holds it)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd, env = _serve(self.port, *options)
        # The server's output goes to a file: a pipe nobody reads would block it once full.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="batchspec-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                up = httpx.get(self.url + "/health", timeout=1).status_code == 200
                if up and (ready is None or ready in self.output()):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(f"the server did not come up in {ready_s:.0f} s:\n{self.output()[-4000:]}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        lines = httpx.get(self.url + "/metrics", timeout=5).text.splitlines()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    srv = Server("--batch-size", "8", "-k", "3")
    yield srv
    assert srv.stop() == 0


def _ids(completion) -> list[int]:
    return completion.model_extra["batchspec"]["token_ids"]


def _complete(srv, prompt, **kw):
    return srv.client.completions.create(model="tiny", prompt=prompt, **kw)


def _stream(srv, prompt, **kw):
    text, ids, finish, usage = "", [], None, None
    for chunk in _complete(srv, prompt, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            ids += (chunk.model_extra.get("batchspec") or {}).get("token_ids", [])
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return text, ids, finish, usage


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}])
def test_streamed_equals_non_streamed(server, sampling):
    prompt = random_prompts(80, 1, 5, 20)[0]
    full = _complete(server, prompt, max_tokens=40, **sampling)
    text, ids, finish, usage = _stream(server, prompt, max_tokens=40, **sampling)
    assert (text, ids, finish) == (full.choices[0].text, _ids(full), full.choices[0].finish_reason)
    assert usage.completion_tokens == full.usage.completion_tokens == len(ids)
    assert usage.prompt_tokens == len(prompt) and usage.total_tokens == len(prompt) + len(ids)
    assert full.model_extra["batchspec"]["steps"] >= 1


def test_chat_streamed_equals_non_streamed(server):
    messages = [{"role": "user", "content": "Héllo, wörld €"}]
    full = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    parts = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert streamed == full.choices[0].message.content and full.choices[0].message.role == "assistant"


def test_max_tokens_stop_and_seed(server):
    prompt = random_prompts(81, 1, 5, 20)[0]
    short = _complete(server, prompt, max_tokens=7, temperature=0)
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (7, "length")
    full = _complete(server, prompt, max_tokens=40, temperature=0)
    assert _ids(full)[:7] == _ids(short) == reference_tokens_64(prompt, 7)
    text = full.choices[0].text
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text[i : i + 2] not in text[: i + 1]
    )
    cut = _complete(server, prompt, max_tokens=40, temperature=0, stop=[stop, "never"])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[: text.index(stop)], "stop")
    assert _stream(server, prompt, max_tokens=40, temperature=0, stop=stop)[0] == cut.choices[0].text
    a, b, c = (_complete(server, prompt, max_tokens=30, temperature=1.0, seed=s) for s in (11, 11, 12))
    assert _ids(a) == _ids(b) != _ids(c)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}])
def test_a_list_of_prompts_gets_one_choice_each_equal_to_the_prompt_alone(server, sampling):
    """`prompt=[p0, p1, p2]`: three rows of the batch, one choice each in prompt order, each the
    tokens that prompt gets alone (greedy: the reference); streamed, the same per index."""
    prompts = random_prompts(85, 3, 3, 25)
    batched = _complete(server, prompts, max_tokens=12, **sampling)
    assert [c.index for c in batched.choices] == [0, 1, 2]
    ids = [c.model_extra["batchspec"]["token_ids"] for c in batched.choices]
    alone = [_ids(_complete(server, p, max_tokens=12, **sampling)) for p in prompts]
    assert ids == alone
    if not sampling.get("seed"):
        assert ids == [reference_tokens_64(p, 12) for p in prompts]
    assert batched.usage.prompt_tokens == sum(map(len, prompts))
    assert batched.usage.completion_tokens == sum(map(len, ids))
    streamed, finished = [[] for _ in prompts], set()
    for chunk in _complete(server, prompts, max_tokens=12, stream=True, **sampling):
        for choice in chunk.choices:
            streamed[choice.index] += (chunk.model_extra.get("batchspec") or {}).get("token_ids", [])
            if choice.finish_reason:
                finished.add(choice.index)
    assert streamed == ids and finished == {0, 1, 2}
    texts = _complete(server, ["Hello", "The sky is"], max_tokens=4, temperature=0)
    assert [c.text for c in texts.choices] == [
        _complete(server, t, max_tokens=4, temperature=0).choices[0].text for t in ("Hello", "The sky is")
    ]


def test_n_choices_use_derived_seeds_and_are_reproducible(server):
    """`n=3, seed=s`: choice j is what the prompt gets alone with seed s + j; the same request
    again gives the same choices; greedy choices are all the reference's tokens."""
    prompt = random_prompts(86, 1, 4, 20)[0]
    first = _complete(server, prompt, max_tokens=10, temperature=0.9, seed=40, n=3)
    again = _complete(server, prompt, max_tokens=10, temperature=0.9, seed=40, n=3)
    ids = [c.model_extra["batchspec"]["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert ids == [c.model_extra["batchspec"]["token_ids"] for c in again.choices]
    assert ids == [_ids(_complete(server, prompt, max_tokens=10, temperature=0.9, seed=40 + j)) for j in range(3)]
    greedy = _complete(server, [prompt, prompt[:3]], max_tokens=6, temperature=0, n=2)
    assert [c.model_extra["batchspec"]["token_ids"] for c in greedy.choices] == (
        [reference_tokens_64(prompt, 6)] * 2 + [reference_tokens_64(prompt[:3], 6)] * 2
    )
    long_prompt = random_prompts(89, 1, 40, 40)[0]
    before = server.metrics()["batchspec_prefix_cache_hits_total"]
    shared = _complete(server, long_prompt, max_tokens=6, temperature=0, n=3)  # one prefill, two from its entries
    assert [c.model_extra["batchspec"]["token_ids"] for c in shared.choices] == [
        reference_tokens_64(long_prompt, 6)
    ] * 3
    assert server.metrics()["batchspec_prefix_cache_hits_total"] - before >= 2
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0.7, seed=1, n=2
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == sum(
        len(c.model_extra["batchspec"]["token_ids"]) for c in chat.choices
    )
    roles = {}
    for chunk in server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, n=2, stream=True
    ):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)  # the first delta of each choice
    assert roles == {0: "assistant", 1: "assistant"}


def _reference_logprobs(prompt, max_new, top):
    from batchspec import SamplingParams, SpecDecoder

    reference_tokens_64(prompt, 1)  # loads the pair
    dec = SpecDecoder(_TINY64["pair"], method="reference")
    return dec.generate([prompt], SamplingParams(max_new_tokens=max_new, logprobs=top))[0].logprobs


def test_completion_logprobs_are_the_targets_own(server):
    """`logprobs=3`: each emitted token's log-probability equals the one-sequence reference's (the
    target's distribution there, not a draft's), the chosen token leads its top 3 under greedy,
    and the stream's logprobs are the same, chunk by chunk, as the whole response's."""
    prompts = random_prompts(87, 2, 4, 20)
    full = _complete(server, prompts, max_tokens=12, temperature=0, logprobs=3)
    for prompt, choice in zip(prompts, full.choices):
        lp, ids = choice.logprobs, choice.model_extra["batchspec"]["token_ids"]
        ref = _reference_logprobs(prompt, 12, 3)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == len(ref)
        assert all(abs(a - b.logprob) < 1e-9 for a, b in zip(lp.token_logprobs, ref))
        assert all(len(top) <= 3 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [[] for _ in prompts]
    for chunk in _complete(server, prompts, max_tokens=12, temperature=0, logprobs=3, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.token_logprobs
    assert streamed == [c.logprobs.token_logprobs for c in full.choices]
    plain = _complete(server, prompts[0], max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_with_top_logprobs(server):
    """Chat `logprobs=True, top_logprobs=2`: one entry per completion token, with its bytes and 2
    alternatives; sampled rows get the distribution after their temperature (the chosen token
    need not lead then, but its logprob is among the row's)."""
    messages = [{"role": "user", "content": "Hello there"}]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 4}):
        out = server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, logprobs=True, top_logprobs=2, **sampling
        )
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens
        for entry in content:
            assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
            if not sampling.get("seed"):
                assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
    stream = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True, stream=True
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [e.logprob for e in content_greedy(server, messages)]
    assert all(e.top_logprobs == [] for e in entries)


def content_greedy(server, messages):
    out = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True
    )
    return out.choices[0].logprobs.content


def test_a_multi_turn_chat_starts_each_turn_from_the_cached_history(server):
    """Each turn resends the history (prompt, answer, new tokens): from the second turn on, the
    prompt begins with the previous turn's cached entries; every answer is the reference's."""
    before = server.metrics()
    prompt = random_prompts(88, 1, 30, 30)[0]
    for _ in range(4):
        out = _complete(server, prompt, max_tokens=10, temperature=0)
        assert _ids(out) == reference_tokens_64(prompt, 10)
        prompt = prompt + _ids(out) + random_prompts(len(prompt), 1, 3, 8)[0]
    after = server.metrics()
    assert after["batchspec_prefix_cache_hits_total"] - before["batchspec_prefix_cache_hits_total"] >= 3
    reused = after["batchspec_prefix_cache_reused_tokens_total"] - before["batchspec_prefix_cache_reused_tokens_total"]
    assert reused >= 3 * 32
    for stage in ("prefill", "verify"):  # the engine's time by stage, as operators read it
        key = f'batchspec_stage_seconds_total{{stage="{stage}"}}'
        assert after[key] > before[key]


_TINY64 = {}


def reference_tokens_64(prompt, max_new):
    if "pair" not in _TINY64:
        import torch

        from batchspec import tiny_pair

        _TINY64["pair"] = tiny_pair(dtype=torch.float64)
    return reference_tokens(_TINY64["pair"], [prompt], max_new)[0]


def test_32_concurrent_streams_with_mixed_parameters(server):
    prompts = random_prompts(82, 32, 2, 40)
    kinds = [
        {"temperature": 0}
        if i % 2 == 0
        else {
            "temperature": 0.6 + 0.1 * (i % 7),
            "top_p": [1.0, 0.9, 0.7][i % 3],
            "seed": i,
            "extra_body": {"top_k": [0, 10, 50][i % 3]},
        }
        for i in range(32)
    ]
    lengths = [8 + (i * 7) % 33 for i in range(32)]
    alone = {i: _ids(_complete(server, prompts[i], max_tokens=lengths[i], **kinds[i])) for i in range(1, 32, 2)}

    async def one(i):
        ids = []
        stream = await server.aclient.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=lengths[i], stream=True, **kinds[i]
        )
        async for chunk in stream:
            ids += (chunk.model_extra.get("batchspec") or {}).get("token_ids", [])
        return ids

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(all_of_them())
    for i, ids in enumerate(results):
        if i % 2 == 0:
            assert ids == reference_tokens_64(prompts[i], lengths[i]), f"greedy request {i}"
        else:
            assert ids == alone[i], f"seeded request {i}"


def test_client_disconnect_frees_its_row(server):
    before = server.metrics().get('batchspec_requests_total{outcome="abort"}', 0)
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 8000,  # long enough to be still running when the client goes
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        # the gauges follow each loop iteration; the first chunk may go out before its iteration ends
        deadline = time.monotonic() + 10
        while server.metrics()["batchspec_running_rows"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.metrics()["batchspec_running_rows"] >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get('batchspec_requests_total{outcome="abort"}', 0) > before and m["batchspec_running_rows"] == 0:
            break
        time.sleep(0.05)
    assert m.get('batchspec_requests_total{outcome="abort"}', 0) == before + 1, server.output()[-4000:]
    assert m["batchspec_running_rows"] == 0 and m["batchspec_kv_slots_used"] == 0
    assert m["batchspec_kv_slots_allocated"] == 0  # every slab freed once its rows left
    held = m.get("batchspec_prefix_cache_held_tokens", 0)
    assert (m["batchspec_kv_bytes"] > 0) == (held > 0)  # what is left is the prefix cache's
    assert m["batchspec_kv_bytes_peak"] > m["batchspec_kv_bytes"]  # 8000 tokens' slabs were held


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": [1, 2], "temperature": "hot"}, "temperature", ["temperature", "hot"]),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", ["max_tokens", ">= 1"]),
        ({"prompt": [1, 2], "n": 0}, "n", ["'n' must be in [1, 16]"]),
        ({"prompt": 5}, "prompt", ["prompt"]),
        ({"prompt": [[1, 2], []]}, "prompt[1]", ["'prompt[1]' must be"]),
        ({"prompt": [[1]] * 65}, "prompt", ["at most 64 prompts"]),
        ({"prompt": [1, 2], "stop": [3]}, "stop", ["stop"]),
        ({"prompt": [1, 2], "stream": "yes"}, "stream", ["stream", "boolean"]),
        ({"prompt": [1, 2], "max_tokens": 20000}, "max_tokens", ["2 tokens", "20000", "KV budget of 16384 tokens"]),
        ({"prompt": [7] * 9000}, "prompt", ["9000 tokens", "context is 8192"]),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_malformed_json_and_unknown_model(server):
    response = httpx.post(server.url + "/v1/completions", content=b'{"prompt": [1,', timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        server.client.completions.create(model="gpt-5", prompt=[1, 2])
    assert "gpt-5" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model="tiny", messages=[{"content": "no role"}])
    assert err.value.body["param"] == "messages[0].role"
    assert [m.id for m in server.client.models.list()] == ["tiny"]


def test_full_queue_is_refused_at_once_and_sigterm_exits_0():
    srv = Server("--batch-size", "1", "--max-queue", "1")
    try:
        long = {
            "model": "tiny",
            "prompt": [1, 2, 3],
            "max_tokens": 600,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", srv.url + "/v1/completions", json=long, timeout=30) as running:
            first = running.iter_lines()  # (an abandoned iterator would close the connection)
            next(first)  # the long request holds the only row for a few seconds
            with (
                httpx.Client(timeout=30) as c,
                c.stream("POST", srv.url + "/v1/completions", json={**long, "max_tokens": 10}) as queued,
            ):
                assert queued.status_code == 200  # queued before its response started
                start = time.monotonic()
                refused = httpx.post(srv.url + "/v1/completions", json={**long, "stream": False}, timeout=10)
                assert refused.status_code == 429 and time.monotonic() - start < 2
                assert refused.json()["error"]["code"] == "queue_full"
                srv.proc.send_signal(signal.SIGTERM)  # in-flight requests finish, then exit 0
                lines = [line for line in queued.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_a_draft_tree_served_concurrently_equals_reference():
    """`serve --proposer eagle --branches 3x2x1 --kv-budget 400`: 8 concurrent greedy requests, each
    equal to the target alone, and the draft slots of a tree (3 + 2 + 1) counted in the KV budget's check."""
    srv = Server("--batch-size", "4", "-k", "3", "--proposer", "eagle", "--branches", "3x2x1", "--kv-budget", "400")
    try:
        prompts = random_prompts(83, 8, 2, 30)

        async def one(i):
            out = await srv.aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, temperature=0)
            return _ids(out)

        async def all_of_them():
            return await asyncio.gather(*(one(i) for i in range(8)))

        for i, ids in enumerate(asyncio.run(all_of_them())):
            assert ids == reference_tokens_64(prompts[i], 24), f"request {i}"
        too_long = random_prompts(84, 1, 355, 356)[0]  # 355 + 40 + 7 draft slots > 400
        with pytest.raises(openai.BadRequestError, match="7 draft slots"):
            _complete(srv, too_long, max_tokens=40)
    finally:
        assert srv.stop() == 0


def test_a_draft_tree_server_with_a_kv_budget_starts_and_answers_exactly():
    """`serve --proposer eagle --branches 4x2x1 --kv-budget 8192`, the draft-slot count taken from
    one place (tree.columns), in a real process: it starts and its greedy answer is the target's."""
    srv = Server("--proposer", "eagle", "--branches", "4x2x1", "--kv-budget", "8192", "-k", "3", "--batch-size", "2")
    try:
        prompt = random_prompts(5, 1)[0]
        out = _complete(srv, prompt, max_tokens=12, temperature=0)
        assert _ids(out) == reference_tokens_64(prompt, 12)
    finally:
        assert srv.stop() == 0


def test_the_kv_budget_check_counts_a_trees_nodes_per_depth():
    """`--branches 3x2x1 -k 3`: a step writes 3 + 2 + 1 draft slots per row, so a budget must
    hold 6 + 2 tokens (the check once multiplied k by the tuple of widths)."""
    from batchspec import cli
    from batchspec.serving import server

    def build(budget):
        argv = ["serve", "--pair", "tiny", "-k", "3", "--proposer", "eagle", "--branches", "3x2x1"]
        return server.build_service(
            cli.serve_config(cli.build_parser().parse_args([*argv, "--kv-budget", str(budget)]))
        )

    with pytest.raises(BatchspecError, match="room for a prompt token and 7 draft slots"):
        build(7)
    service = build(8)
    assert service.k == 6
    service.engine.shutdown()


def _served_logprobs(options: tuple[str, ...], prompts, top: int, model: str = "tiny"):
    """Start `serve *options`, send `prompts` as concurrent greedy completions with `logprobs=top`
    (rows of one batch, admitted mid-flight), stop it -> (token ids, logprobs, top lists) per prompt."""
    srv = Server(*options)
    try:

        async def ask(p):
            return await srv.aclient.completions.create(
                model=model, prompt=p, max_tokens=16, temperature=0, logprobs=top
            )

        async def all_of():
            return await asyncio.gather(*(ask(p) for p in prompts))

        outs = asyncio.run(all_of())
    finally:
        assert srv.stop() == 0
    return [(_ids(o), o.choices[0].logprobs.token_logprobs, o.choices[0].logprobs.top_logprobs) for o in outs]


def _reference_under_the_mode(dtype, prompts, top: int):
    """The target alone, one prompt at a time, under the batch-invariant mode -> (token ids,
    logprobs) per prompt."""
    from batchspec import EngineConfig, SamplingParams, SpecDecoder, tiny_pair

    ref = SpecDecoder(tiny_pair(dtype=dtype), EngineConfig(method="reference", batch_invariant=True))
    params = SamplingParams(max_new_tokens=16, logprobs=top)
    outs = [ref.generate([p], params)[0] for p in prompts]
    return [(o.token_ids, [e.logprob for e in o.logprobs]) for o in outs]


@NEEDS_ONEDNN_BF16
def test_a_batch_invariant_bfloat16_server_answers_concurrent_clients_as_the_target_alone():
    """`serve --dtype bfloat16 --batch-invariant`: concurrent greedy requests get the bf16 target's
    own tokens and logprobs, bit for bit."""
    import torch

    prompts = random_prompts(21, 5, 1, 80)
    want = _reference_under_the_mode(torch.bfloat16, prompts, 0)
    got = _served_logprobs(("--dtype", "bfloat16", "--batch-invariant", "-k", "3", "--batch-size", "4"), prompts, 0)
    assert [(ids, lps) for ids, lps, _ in got] == want


def test_float32_logprobs_are_bit_equal_with_and_without_speculation_under_the_mode():
    """`serve --dtype float32 --batch-invariant` speculating (`-k 3`, the tiny pair's draft) and
    with `--no-spec`: concurrent greedy requests get the same tokens, logprobs and top-3 alternatives,
    bit for bit, and the logprobs are the float32 target's own (the reference's). Without the mode
    they agree to ~1e-5 only (a multi-token forward rounds differently from a one-token one)."""
    import torch

    prompts = random_prompts(33, 5, 1, 80)
    want = _reference_under_the_mode(torch.float32, prompts, 3)
    base = ("--dtype", "float32", "--batch-invariant", "--batch-size", "4")
    spec = _served_logprobs(base + ("-k", "3"), prompts, 3)
    plain = _served_logprobs(base + ("--no-spec",), prompts, 3)
    assert spec == plain
    assert [(ids, lps) for ids, lps, _ in spec] == want
    assert all(max(top.values()) == lp for _, lps, tops in spec for top, lp in zip(tops, lps))


def test_a_sliding_window_model_serves_concurrent_clients_as_the_reference():
    """`serve --pair tiny-sliding` (Gemma 3-style, window 6): concurrent greedy requests with
    prompts several windows long get the reference's tokens."""
    import torch

    from batchspec import SamplingParams, SpecDecoder, tiny_pair

    prompts = random_prompts(34, 5, 10, 60)
    ref = SpecDecoder(tiny_pair(dtype=torch.float64, sliding=True), method="reference")
    want = [ref.generate([p], SamplingParams(max_new_tokens=16, logprobs=0))[0] for p in prompts]
    got = _served_logprobs(("--pair", "tiny-sliding", "-k", "3", "--batch-size", "4"), prompts, 0, "tiny-sliding")
    assert [ids for ids, _, _ in got] == [w.token_ids for w in want]
    for (_, lps, _), w in zip(got, want):
        assert len(lps) == len(w.logprobs) and all(abs(a - b.logprob) < 1e-9 for a, b in zip(lps, w.logprobs))


def test_a_port_in_use_fails_naming_it(server):
    """A second server on a port in use stops at once with a non-zero status (uvicorn's 3) and
    says why, instead of serving nothing; the first one serves on."""
    cmd, env = _serve(server.port)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "address already in use" in done.stderr
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # the first one serves on


@pytest.mark.parametrize("spin", [None, "off", "on", "auto"])
def test_under_spin_the_models_load_on_the_thread_that_runs_the_engine_loop(monkeypatch, spin):
    """With `--spin auto` (the default) or `--spin` (on) every torch call of a server runs on one
    thread (not the event loop's): the models load, the machine is measured and the loop steps on
    the engine thread, so the CPU's OpenMP threads form one team; under auto the loop holds a
    threads.Spin. With `--spin off` the models load on the calling thread and the loop runs on its
    own (two teams). The output is the reference's either way."""
    from batchspec import SamplingParams, cli
    from batchspec.core.sequence import Sequence
    from batchspec.engine.online import Request
    from batchspec.models.pair import PairSpec
    from batchspec.serving import server

    threads = {"load": set(), "forward": set()}
    load = PairSpec.load
    monkeypatch.setattr(PairSpec, "load", lambda self: threads["load"].add(threading.get_ident()) or load(self))
    argv = ["serve", "--pair", "tiny", "-k", "3"] + {None: [], "on": ["--spin"]}.get(spin, ["--spin", str(spin)])
    config = cli.serve_config(cli.build_parser().parse_args(argv))
    service = server.build_service(config)
    service.engine.ctx.target.register_forward_pre_hook(lambda *_: threads["forward"].add(threading.get_ident()))
    service.engine.start()
    try:
        prompt = random_prompts(11, 1)[0]
        done, tokens = threading.Event(), []

        def emit(chunk):
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                done.set()

        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        seq = Sequence.request(0, prompt, params, service.context, service.pair.eos_ids)
        service.engine.submit(Request(seq, emit))
        assert done.wait(60)
    finally:
        service.engine.shutdown()
    assert not service.engine.thread.is_alive()
    assert threads["forward"] == {service.engine.thread.ident} != {threading.get_ident()}
    one_team = spin != "off"  # auto by default
    assert threads["load"] == ({service.engine.thread.ident} if one_team else {threading.get_ident()})
    assert (service.engine.spin is not None) == (spin in (None, "auto"))
    assert tokens == reference_tokens_64(prompt, 12)
