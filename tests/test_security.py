"""`batchspec serve` with API keys and bounded requests, as clients meet it: a real server process
on 127.0.0.1 (the tiny pair) with keys from all three sources, the official `openai` client, a raw
socket for malformed and oversized bodies, and a fuzz pass over request shapes. No traffic goes
anywhere but 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import SRC, Server, reference_tokens_64

from batchspec import cli
from batchspec.core.errors import BatchspecError
from batchspec.serving import access
from batchspec.serving.openai_api import MAX_MESSAGES, MAX_STOP_CHARS

KEYS = ("sk-flag-3f9a0c", "sk-file-71c2d8", "sk-env-b7e04f")  # --api-key, --api-key-file, environment
WRONG = "sk-wrong-5d1e9b"
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\n\n{KEYS[1]}\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(access.ENV_KEY, KEYS[2])
        options = ("--api-key", KEYS[0], "--api-key-file", str(keys), "--body-timeout", "1")
        srv = Server("--batch-size", "2", "-k", "2", "--kv-budget", "256", *options)
    yield srv
    assert srv.stop() == 0


def _client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _post(srv, path: str, body, key: str | None = KEYS[0], **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers.setdefault("Content-Type", "application/json")
    headers.update(kw.pop("headers", {}))
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=10, **kw)


def _greedy(srv, key: str = KEYS[0]) -> list[int]:
    out = _client(srv, key).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    return out.model_extra["batchspec"]["token_ids"]


# --- keys ---------------------------------------------------------------------------------------
def test_every_key_works_with_the_openai_client(server):
    answers = [_greedy(server, key) for key in KEYS]
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 6
    stream = _client(server, KEYS[2]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert [m.id for m in _client(server, KEYS[1]).models.list()] == ["tiny"]


@pytest.mark.parametrize("key", [WRONG, KEYS[0] + "x", KEYS[0][:-1]])
def test_a_wrong_key_is_401(server, key):
    with pytest.raises(openai.AuthenticationError) as err:
        _client(server, key).completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert "not valid" in err.value.body["message"] and key not in err.value.body["message"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer"}, {"Authorization": KEYS[0]}],
)
def test_no_key_is_401_in_openai_shape(server, headers):
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
        response = httpx.request(method, server.url + path, headers=headers, json={"prompt": [1]}, timeout=10)
        assert response.status_code == 401, (path, response.text)
        assert response.json() == {
            "error": {
                "message": "no API key given: send it as 'Authorization: Bearer <key>'",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert response.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_are_open_and_other_paths_are_not(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=10)
    assert metrics.status_code == 200 and 'batchspec_requests_total{outcome="unauthorized"}' in metrics.text
    assert not any(key in metrics.text for key in (*KEYS, WRONG))
    for path in ("/openapi.json", "/docs", "/nowhere", "/v1/nowhere"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401, path
    assert httpx.get(server.url + "/v1/nowhere", headers=_auth(KEYS[0]), timeout=10).status_code == 404


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_metrics_auth_puts_metrics_behind_the_key():
    with pytest.MonkeyPatch.context() as env:
        env.setenv(access.ENV_KEY, KEYS[2])
        srv = Server("--batch-size", "1", "-k", "1", "--metrics-auth")
    try:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        refused = httpx.get(srv.url + "/metrics", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/metrics", headers=_auth(WRONG), timeout=10).status_code == 401
        allowed = httpx.get(srv.url + "/metrics", headers=_auth(KEYS[2]), timeout=10)
        assert allowed.status_code == 200 and "batchspec_running_rows" in allowed.text
        assert _greedy(srv, KEYS[2])
    finally:
        assert srv.stop() == 0


# --- malformed and oversized requests -------------------------------------------------------------
@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"prompt": [1,', "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": [1], "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'"just a string"', "must be a JSON object"),
    ],
)
def test_malformed_json_is_400(server, body, words):
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_a_body_that_is_not_json_is_415(server, kind):
    response = _post(server, "/v1/completions", {"prompt": [1], "max_tokens": 1}, headers={"Content-Type": kind})
    error = response.json()["error"]
    assert response.status_code == 415 and error["code"] == "unsupported_media_type" and kind in error["message"]
    ok = _post(
        server,
        "/v1/completions",
        {"prompt": [1], "max_tokens": 1},
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "chat, body, param, words",
    [
        (False, {"prompt": [1], "stop": ["a", "b", "c", "d", "e"]}, "stop", ["at most 4 strings, got 5"]),
        (False, {"prompt": [1], "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", [f"at most {MAX_STOP_CHARS} characters"]),
        (False, {"prompt": [1], "logit_bias": {"5": 10}}, "logit_bias", ["'logit_bias' is not supported"]),
        (False, {"prompt": [1], "presence_penalty": 0.5}, "presence_penalty", ["not supported"]),
        (False, {"prompt": [1], "logprobs": 21}, "logprobs", ["'logprobs' must be in [0, 20], got 21"]),
        (False, {"prompt": [1], "echo": True}, "echo", ["'echo' is not supported"]),
        (True, {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", ["a boolean"]),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            ["'top_logprobs' needs 'logprobs': true"],
        ),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            ["in [0, 20]"],
        ),
        (True, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]", []),
        (True, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice", ["needs"]),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format",
            ["'response_format.type' must be 'text', 'json_object' or 'json_schema'"],
        ),
        (True, {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, "modalities", []),
        (
            True,
            {"messages": [{"role": "user", "content": "x"}], "prompt": "y"},
            "prompt",
            ["'prompt' is not a field /v1/chat/completions serves"],
        ),
        (False, {"prompt": [1], "best_fo": 2}, "best_fo", ["'best_fo' is not a field /v1/completions serves"]),
        (False, {"prompt": [1], "n": 17}, "n", ["'n' must be in [1, 16]"]),
        (False, {"prompt": [[1]] * 8, "n": 9}, "n", ["8 prompts x n = 9 would make more than 64 choices"]),
        (False, {"prompt": [1], "max_tokens": 10**30}, "max_tokens", ["KV budget of 256 tokens"]),
        (False, {"prompt": [1, 100_000]}, "prompt", ["100000 is outside the vocabulary"]),
        (False, {"prompt": [7] * 9000}, "prompt", ["9000 tokens", "context is 8192"]),
        (True, {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages", ["at most 1024"]),
    ],
)
def test_request_bounds_are_400s_naming_the_field(server, chat, body, param, words):
    response = _post(server, "/v1/chat/completions" if chat else "/v1/completions", {"max_tokens": 2, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, response.text
    assert all(w in error["message"] for w in words), error["message"]


@pytest.mark.parametrize(
    "neutral",
    [{"logit_bias": {}}, {"presence_penalty": 0.0}, {"logprobs": None}, {"user": "u1"}, {"metadata": {"a": "b"}}],
)
def test_unserved_fields_at_their_neutral_value_are_accepted(server, neutral):
    assert _post(server, "/v1/completions", {"prompt": [1], "max_tokens": 1, **neutral}).status_code == 200


def _head(path: str, key: str | None, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"Authorization: Bearer {key}"] * (key is not None)
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _raw(srv, head: bytes, parts, wait: float = 10) -> tuple[int, dict, float, bool]:
    """Send `head`, then `parts` from a thread (until the server stops reading); (status, error
    body, seconds to the response, whether the server closed the connection)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=wait)
    start = time.monotonic()
    sock.sendall(head)

    def send():
        try:
            for part in parts:
                sock.sendall(part)
        except OSError:
            pass  # the server answered and closed

    threading.Thread(target=send, daemon=True).start()
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - start
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with the rest of the body unread
            closed = True
    finally:
        sock.close()
    head_part, _, body = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(body), elapsed, closed


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_a_5_mib_body_is_413_within_a_second(server):
    body = b"x" * (5 * MIB)
    parts = (body[i : i + 65536] for i in range(0, len(body), 65536))
    status, body, elapsed, closed = _raw(server, _head("/v1/completions", KEYS[0], Content_Length=str(5 * MIB)), parts)
    assert (status, body["error"]["code"], closed) == (413, "request_too_large", True) and elapsed < 1.0
    assert "5242880 bytes" in body["error"]["message"] and f"at most {MIB} bytes" in body["error"]["message"]
    assert _greedy(server)


def test_a_5_mib_chunked_body_is_413_within_a_second(server):
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"  # 64 KiB chunks, no Content-Length
    parts = (chunk for _ in range(80))
    status, body, elapsed, closed = _raw(server, _head("/v1/completions", KEYS[0], Transfer_Encoding="chunked"), parts)
    assert (status, body["error"]["code"], closed) == (413, "request_too_large", True) and elapsed < 1.0
    assert f"over {MIB} bytes" in body["error"]["message"]
    assert _greedy(server)


def test_an_unfinished_body_is_cut_off(server):
    head = _head("/v1/completions", KEYS[0], Content_Length="100")
    status, body, elapsed, closed = _raw(server, head, [b'{"prompt": [1'])
    assert (status, body["error"]["code"], closed) == (408, "request_timeout", True), body
    assert 0.9 < elapsed < 5 and "within 1 s" in body["error"]["message"]
    assert _greedy(server)


def test_an_unauthorized_body_is_not_read(server):
    head = _head("/v1/completions", None, Content_Length=str(5 * MIB))
    status, body, elapsed, closed = _raw(server, head, [])  # no body at all: refused on the headers
    assert (status, body["error"]["code"], closed) == (401, "invalid_api_key", True) and elapsed < 1.0


def test_oversized_headers_are_400(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(_head("/v1/completions", KEYS[0], X_Padding="x" * 20_000))
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")


# --- fuzz -----------------------------------------------------------------------------------------
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
ANY = st.recursive(
    LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12
)
WRONG_FIELDS = {
    "model": st.one_of(st.just("tiny"), ANY),
    "prompt": st.one_of(st.lists(st.integers(-3, 400), max_size=12), st.text(max_size=24), ANY),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | ANY, "content": ANY}), max_size=3
        ),
        ANY,
    ),
    "max_tokens": st.one_of(st.integers(-2, 4), st.integers(300, 10**40), ANY),
    "max_completion_tokens": st.one_of(st.integers(-2, 4), ANY),
    "temperature": st.one_of(st.floats(-1, 3), ANY),
    "top_p": st.one_of(st.floats(-1, 2), ANY),
    "top_k": st.one_of(st.integers(-3, 10**30), ANY),
    "seed": st.one_of(st.integers(-(2**80), 2**80), ANY),
    "n": st.one_of(st.integers(-1, 5), ANY),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=300), max_size=6), ANY),
    "stream": st.one_of(st.booleans(), ANY),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans() | ANY}), ANY),
    "ignore_eos": st.one_of(st.booleans(), ANY),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=4), st.integers(-100, 100), max_size=3), ANY),
    "presence_penalty": ANY,
    "logprobs": ANY,
    "top_logprobs": st.one_of(st.integers(-2, 25), ANY),
}
GOOD_FIELDS = {
    "model": st.just("tiny"),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 10**30),
    "seed": st.integers(-(2**80), 2**80),
    "n": st.just(1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "logit_bias": st.just({}),
    "user": st.text(max_size=8),
}
BASE = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 255), min_size=1, max_size=12) | st.text(min_size=1, max_size=24),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text()}),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": st.integers(1, 4),
    }
)


def _fields(strategies: dict) -> st.SearchStrategy:
    """Lists of (name, value) pairs drawn from `strategies`."""
    pair = st.sampled_from(sorted(strategies)).flatmap(lambda name: strategies[name].map(lambda v: (name, v)))
    return st.lists(pair, max_size=3)


#: Mostly a valid request with some fields set well and up to three set wrong; else any JSON, or bytes.
BODIES = st.one_of(
    *[
        st.builds(
            lambda base, good, bad: {**base, **dict(good), **dict(bad)},
            BASE,
            _fields(GOOD_FIELDS),
            _fields(WRONG_FIELDS),
        )
    ]
    * 4,
    ANY,
    st.binary(max_size=64),
)


@settings(max_examples=150, deadline=timedelta(seconds=10))
@given(chat=st.booleans(), body=BODIES)
def test_fuzzed_requests_get_a_4xx_or_an_answer(server, chat, body):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = _post(server, path, body)
    assert response.status_code in (200, 400, 404), (response.status_code, response.text[:500])
    if response.status_code != 200:
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_server_answers_correctly_after_the_fuzz(server):
    assert _greedy(server) == reference_tokens_64([5, 6, 7], 6)
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_no_key_appears_in_the_log(server):
    with pytest.raises(openai.AuthenticationError):
        _client(server, WRONG).models.list()
    log = server.output()
    assert "batchspec: serving" in log and not any(key in log for key in (*KEYS, WRONG)), log[-3000:]


# --- start-up -------------------------------------------------------------------------------------
def _serve(*options: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != access.ENV_KEY}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "batchspec.cli", "serve", "--pair", "tiny", *options]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_require_api_key_refuses_to_start_without_one():
    run = _serve("--host", "0.0.0.0", "--port", "1", "--require-api-key")
    assert run.returncode == 2 and "--require-api-key: no API key is set" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "serving" not in run.stderr


def test_a_public_host_without_a_key_warns_at_start_up(monkeypatch, capsys):
    from batchspec.serving import server

    monkeypatch.delenv(access.ENV_KEY, raising=False)
    monkeypatch.setattr(server, "run_cli", lambda config: 0)  # nothing is bound
    assert cli.main(["serve", "--pair", "tiny", "--host", "0.0.0.0", "--port", "1"]) == 0
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "warning: serving on 0.0.0.0 without an API key" in warning
    assert "--api-key" in warning
    assert cli.main(["serve", "--pair", "tiny", "--host", "0.0.0.0", "--port", "1", "--api-key", "k"]) == 0
    assert capsys.readouterr().err == ""


def test_options_that_would_leave_the_server_open_are_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(access.ENV_KEY, raising=False)
    empty = tmp_path / "keys.txt"
    empty.write_text("# nothing yet\n\n")
    for options, words in [
        (["--api-key-file", str(empty)], "holds no keys"),
        (["--metrics-auth"], "--metrics-auth needs an API key"),
        (["--require-api-key"], "--require-api-key: no API key is set"),
        (["--api-key", "k", "--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
        (["--api-key", "k", "--body-timeout", "0"], "--body-timeout must be > 0"),
    ]:
        assert cli.main(["serve", "--pair", "tiny", "--port", "1", *options]) == 2
        assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "host, keys, warns",
    [
        ("0.0.0.0", (), True),
        ("::", (), True),
        ("192.168.1.20", (), True),
        ("my-host.example", (), True),
        ("0.0.0.0", ("k",), False),
        ("127.0.0.1", (), False),
        ("127.0.0.2", (), False),
        ("::1", (), False),
        ("localhost", (), False),
    ],
)
def test_a_public_host_without_a_key_warns(host, keys, warns):
    warning = access.check_binding(host, keys, require=False)
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "--api-key" in warning and "\n" not in warning


def test_keys_are_read_from_every_source_and_checked(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# comment\n\n  sk-b  \nsk-c\n")
    assert access.read_keys(["sk-a"], str(path), {access.ENV_KEY: "sk-d"}) == ("sk-a", "sk-b", "sk-c", "sk-d")
    assert access.read_keys(None, None, {}) == ()
    for flags, env, words in [
        ([""], {}, "--api-key: the key is empty"),
        (["sk secret"], {}, "printable ASCII without spaces"),
        (None, {access.ENV_KEY: ""}, f"{access.ENV_KEY}: the key is empty"),
    ]:
        with pytest.raises(BatchspecError, match=words) as err:
            access.read_keys(flags, None, env)
        assert "secret" not in str(err.value)
    with pytest.raises(BatchspecError, match="cannot read it"):
        access.read_keys(None, str(tmp_path / "missing.txt"), {})
    assert "sk-a" not in repr(access.Policy(keys=("sk-a",)))


def test_key_check_and_bearer_parsing():
    keys = ("sk-one", "sk-two")
    assert access.key_ok(b"sk-two", keys) and not access.key_ok(b"sk-tw", keys) and not access.key_ok(None, keys)
    assert access.bearer([(b"authorization", b"bearer  sk-one ")]) == b"sk-one"
    assert access.bearer([(b"authorization", b"Basic sk-one")]) is None
    assert access.bearer([(b"host", b"x")]) is None


def test_the_replica_app_checks_keys_the_same_way():
    """What every Ray Serve replica hosts (server.create_app over build_service), from the same
    options: the keys reach it and it refuses without one, naming the replica."""
    from fastapi.testclient import TestClient

    from batchspec.serving import server

    args = cli.build_parser().parse_args(["serve", "--pair", "tiny", "--api-key", KEYS[0], "--metrics-auth"])
    service = server.build_service(cli.serve_config(args))
    with TestClient(server.create_app(service, replica="r7")) as client:
        refused = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert (refused.status_code, refused.headers["x-batchspec-replica"]) == (401, "r7")
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/metrics").status_code == 401 and client.get("/health").status_code == 200
        answer = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers=_auth(KEYS[0]))
        assert answer.status_code == 200 and len(answer.json()["batchspec"]["token_ids"]) == 1
    service.engine.shutdown()
