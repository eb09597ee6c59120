"""Tensor parallelism on CPU (gloo, 2 ranks): the tiny pair's target (4 heads, 2 KV heads)
sharded with transformers' TP plan decodes the same tokens as one process, in float32, for every
method, greedy and seeded sampling; both ranks agree even on unseeded sampling. The server on 2
ranks answers concurrent requests as one process would, constrained ones too, and stays in lockstep
across a dropped stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import one_thread, random_prompts
from test_grammar import SCHEMA
from test_server import Server
from tp_worker import RUNS, decode_all

from batchspec import SamplingParams, SpecDecoder, cli

TESTS = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(TESTS), "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done


def test_every_method_with_tp2_equals_one_process(tmp_path, tiny32):
    prompts = random_prompts(120, 6, 2, 40)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    _run([*launcher, os.path.join(TESTS, "tp_worker.py"), str(tmp_path), str(tmp_path / "prompts.json")])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the ranks ran in lockstep
    with one_thread():
        alone = decode_all(tiny32, prompts)
    for key, tokens in ranks[0].items():
        if not key.endswith("/unseeded"):
            assert tokens == alone[key], key
    assert set(RUNS) == {key.split("/")[1] for key in ranks[0]}


def test_generate_cli_with_tp2_equals_reference(tmp_path, tiny32):
    prompts = ["Why is the sky blue?", "Write a haiku about the sea.", "Tensor parallel, twice."]
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "batchspec.cli", "generate", "--pair", "tiny", "--tp", "2", "--method", "ragged"]
    done = _run([*cmd, "--max-new-tokens", "32", "--json", str(out), "--quiet", *prompts])
    results = json.loads(out.read_text())["results"]
    with one_thread():
        reference = SpecDecoder(tiny32, method="reference").generate(prompts, SamplingParams(max_new_tokens=32))
    assert [r["token_ids"] for r in results] == [o.token_ids for o in reference]
    assert done.stdout.count("--- [0]") == 1  # only rank 0 prints


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--pair", "tiny", "--tp", "3"], ["4 attention heads", "2 KV heads", "divisible by 3"]),
        (["--pair", "tiny", "--tp", "0"], ["--tp must be >= 1"]),
    ],
)
def test_tp_refuses_a_target_it_cannot_split(capsys, argv, words):
    assert cli.main(["generate", *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_serve_with_tp2_answers_as_one_process(tiny64):
    srv = Server("--tp", "2", "--batch-size", "4", "-k", "3", ready_s=120)
    try:
        prompts = random_prompts(130, 8, 2, 30)
        kinds = [{"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i} for i in range(8)]
        # Grammars too: each rank keeps its own matcher, advanced by the same committed tokens.
        grammars = [{}, {"json_schema": SCHEMA}, {}, {"regex": "[0-9]{3}-[a-z]{2,9}"}] * 2
        extra = [{"structured_outputs": {"json": g["json_schema"]}} if "json_schema" in g else {} for g in grammars]
        extra = [{"structured_outputs": g} if "regex" in g else e for g, e in zip(grammars, extra)]

        def ask(i: int) -> list[int]:
            out = srv.client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=20, extra_body=extra[i], **kinds[i]
            )
            return out.model_extra["batchspec"]["token_ids"]

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(8)))
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as dropped:
            assert next(dropped.iter_lines()).startswith("data: ")
        assert ask(0) == answers[0]  # the ranks are still in lockstep after the cancellation
        deadline = time.monotonic() + 10
        while srv.metrics()["batchspec_running_rows"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.metrics()["batchspec_running_rows"] == 0
        with one_thread():
            for i, params in enumerate(kinds):
                alone = SpecDecoder(tiny64, method="ragged", k=3).generate(
                    [prompts[i]], SamplingParams(max_new_tokens=20, **params, **grammars[i])
                )
                assert answers[i] == alone[0].token_ids, f"request {i}"
    finally:
        assert srv.stop() == 0, srv.output()[-4000:]
