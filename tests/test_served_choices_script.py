"""experiments/served_choices.py and served_steps.py end to end on the tiny pair: a real recording
server answers concurrent requests, writes its record as it exits, and the summary accounts for it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import ROOT, run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record(script_name: str, out, tmp_path) -> None:
    """Run a recording server of `script_name` on the tiny pair, answer 8 requests, stop it."""
    port = _free_port()
    src = os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}
    script = os.path.join(ROOT, "experiments", script_name)
    serve = ["serve", "--pair", "tiny", "--proposer", "ngram", "--port", str(port)]
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, script, "--json", str(out), *serve], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": "one two three one two three one two three", "max_tokens": 24, "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(url, json=body, timeout=120), range(8)))
        assert all(a.status_code == 200 for a in answers)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_served_choices_tiny(tmp_path):
    out = tmp_path / "choices.json"
    _record("served_choices.py", out, tmp_path)
    steps = json.loads(out.read_text())["steps"]
    assert steps and all({"rows", "span", "width", "predicted_ms", "drafting_ms"} <= set(s) for s in steps)
    assert all(s["predicted_ms"]["0"] > 0 for s in steps)
    groups = json.loads(run_script("served_choices.py", "--summary", str(out), "--rows", "1").stdout)
    timed = [s for s in steps if s.get("timed_ms") is not None]
    assert sum(g["steps"] for g in groups) == len(timed) > 0
    assert all(g["timed_ms"] > 0 and g["gain_realised"] > 0 for g in groups)


def test_served_steps_tiny(tmp_path):
    out = tmp_path / "steps.json"
    _record("served_steps.py", out, tmp_path)
    steps = json.loads(out.read_text())["steps"]
    keys = {"rows", "span", "width", "tokens", "wall_s", "draft_s", "verify_s", "rider_tokens", "carried"}
    assert steps and all(keys == set(s) and s["wall_s"] >= s["verify_s"] > 0 for s in steps)
    assert sum(s["tokens"] for s in steps) > 0
    groups = json.loads(run_script("served_steps.py", "--summary", str(out)).stdout)
    assert sum(g["steps"] for g in groups) == len(steps)
    assert all(g["wall_ms"] > 0 and g["tokens_a_row"] >= 1 for g in groups)
