"""`batchspec serve --replicas 2`: two Ray Serve replicas of the tiny pair (float64) in a real
process on 127.0.0.1, called with the official `openai` client. Requests are answered by both
replicas (the `x-batchspec-replica` header), token for token as the reference; a killed replica
is replaced while the other keeps answering; a dropped stream leaves no running row."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers import one_thread, random_prompts, reference_tokens
from test_server import Server

from batchspec import cli

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
HEADER = "x-batchspec-replica"


KEY = "sk-replicas-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def replicas():
    options = ("--replicas", "2", "--batch-size", "4", "-k", "3", "--max-queue", "8", "--api-key", KEY)
    srv = Server(*options, ready="batchspec: serving on", ready_s=180)
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield srv
    assert srv.stop() == 0, srv.output()[-4000:]


def _ask(srv, prompt: list[int], max_tokens: int, stream: bool) -> tuple[str, list[int]]:
    """(replica, token ids) of one greedy request, streamed or not."""
    raw = srv.client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream
    )
    if not stream:
        return raw.headers[HEADER], raw.parse().model_extra["batchspec"]["token_ids"]
    ids = []
    for chunk in raw.parse():
        ids += (chunk.model_extra.get("batchspec") or {}).get("token_ids", [])
    return raw.headers[HEADER], ids


def _run(srv, pair, seed: int, n: int) -> set[str]:
    """n requests, 4 at a time, half of them streamed; each equals the reference. The replicas."""
    prompts = random_prompts(seed, n, 2, 30)
    lengths = [8 + (i * 5) % 25 for i in range(n)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _ask(srv, prompts[i], lengths[i], i % 2 == 1), range(n)))
    with one_thread():
        for i, (_, ids) in enumerate(answers):
            assert ids == reference_tokens(pair, [prompts[i]], lengths[i])[0], f"request {i}"
    return {name for name, _ in answers}


def _health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def _metrics(srv) -> tuple[str, dict[str, float]]:
    response = httpx.get(srv.url + "/metrics", timeout=10)
    lines = response.text.splitlines()
    return response.headers[HEADER], {
        k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    }


@needs_ray
def test_the_key_is_checked_behind_ray_serves_proxy(replicas):
    """`--api-key` under `--replicas`: each replica's app checks it, so the proxy's answers do."""
    wrong = openai.OpenAI(base_url=replicas.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert err.value.body["code"] == "invalid_api_key"
    assert httpx.post(replicas.url + "/v1/completions", json={"model": "tiny"}, timeout=30).status_code == 401
    assert httpx.get(replicas.url + "/health", timeout=10).status_code == 200
    ids = replicas.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert ids.choices[0].finish_reason in ("length", "stop")


@needs_ray
def test_a_dropped_stream_leaves_no_running_row(replicas):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8000, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", replicas.url + "/v1/completions", json={**body, "ignore_eos": True}, headers=AUTH, timeout=30
    ) as r:
        name, lines = r.headers[HEADER], r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline, seen = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        replica, m = _metrics(replicas)
        if replica == name:
            seen = m
            aborted = m.get('batchspec_requests_total{outcome="abort"}', 0) >= 1
            if aborted and m["batchspec_running_rows"] == 0 and m["batchspec_kv_slots_used"] == 0:
                break  # (the gauges are read between iterations: slots may lag the rows by one)
        time.sleep(0.1)
    assert seen is not None and seen["batchspec_running_rows"] == 0, replicas.output()[-4000:]
    assert seen['batchspec_requests_total{outcome="abort"}'] >= 1 and seen["batchspec_kv_slots_used"] == 0


@needs_ray
def test_past_the_queue_bound_requests_are_refused_at_once(replicas):
    """A burst of 48 requests on 2 x 4 rows: Serve holds about --max-queue (8) of those it cannot
    place and answers the rest 503 at once; everything it took is answered. Serve counts the queue
    per router and while replicas report their load, so only the 8 rows are a firm lower bound."""
    url = replicas.url + "/v1/completions"
    body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 100, "ignore_eos": True}
    with ThreadPoolExecutor(48) as pool:
        codes = list(pool.map(lambda _: httpx.post(url, json=body, headers=AUTH, timeout=60).status_code, range(48)))
    assert codes.count(503) >= 1 and codes.count(200) >= 8 and set(codes) <= {200, 429, 503}, codes


@needs_ray
def test_both_replicas_answer_and_a_killed_one_is_replaced(replicas, tiny64):
    assert len(_run(replicas, tiny64, 90, 15)) == 2  # both replicas answered
    victim = _health(replicas)
    os.kill(victim["pid"], signal.SIGKILL)
    survivors = _run(replicas, tiny64, 91, 15)  # the following requests all succeed
    assert victim["replica"] not in survivors
    deadline, names = time.monotonic() + 120, set()
    while time.monotonic() < deadline and len(names - {victim["replica"], *survivors}) == 0:
        names.add(_health(replicas)["replica"])
        time.sleep(0.2)
    assert names - {victim["replica"], *survivors}, "no new replica appeared"


def test_replicas_without_ray_name_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert cli.main(["serve", "--pair", "tiny", "--replicas", "2"]) == 2
    assert "pip install 'batchspec[ray]'" in capsys.readouterr().err


@needs_ray
def test_serve_config_builder_sets_serve_options():
    from batchspec.replicas import app

    deployment = app({"argv": "--pair tiny --replicas 3 --batch-size 6 --replica-cpus 0.5 --max-queue 9"})
    deployment = deployment._bound_deployment
    assert (deployment.num_replicas, deployment.max_ongoing_requests, deployment.max_queued_requests) == (3, 6, 9)
    assert deployment.ray_actor_options["num_cpus"] == 0.5
    assert deployment._deployment_config.health_check_period_s == 1.0  # a dead replica noticed within a second


def test_health_names_the_replica_and_fails_on_a_stalled_or_dead_engine(monkeypatch):
    from fastapi.testclient import TestClient

    from batchspec.serving import server

    service = server.build_service(cli.serve_config(cli.build_parser().parse_args(["serve", "--pair", "tiny"])))
    with TestClient(server.create_app(service, replica="r7")) as client:
        up = client.get("/health")
        assert (up.status_code, up.headers[HEADER], up.json()["replica"]) == (200, "r7", "r7")
        assert client.get("/v1/models").headers[HEADER] == "r7"
        monkeypatch.setattr(server, "STALL_S", -1.0)  # any wait counts as a stall
        stalled = client.get("/health")
        assert stalled.status_code == 503 and "has not iterated" in stalled.json()["error"]
    service.engine.shutdown()
    assert "not running" in service.engine.fault(server.STALL_S)
