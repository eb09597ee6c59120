"""experiments/compiled_forward.py, compiled_step.py, forward_profile.py and planned_step.py end to
end on the default pair: every variant is timed at every shape, the compiled pair gives the eager
pair's tokens, and planned attention the per-layer calls'."""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT, run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand

PROMPTS = os.path.join(ROOT, "..", "shared", "data", "spec_bench", "question.jsonl")


def test_compiled_forward(tmp_path):
    out = tmp_path / "forward.json"
    args = ["--shapes", "1x1,2x3", "--repeats", "1", "--calls", "2", "--variants", "transformers,compiled"]
    run_script("compiled_forward.py", *args, "--json", str(out), timeout=900)
    report = json.loads(out.read_text())
    assert [(r["rows"], r["q"]) for r in report["rows"]] == [(1, 1), (2, 3)]
    assert all(r["transformers_ms"] > 0 and r["compiled_ms"] > 0 for r in report["rows"])
    assert report["compile_s"]["compiled"] > 0


@pytest.mark.skipif(not os.path.exists(PROMPTS), reason="the Spec-Bench prompts are not beside the checkout")
def test_compiled_step(tmp_path):
    out = tmp_path / "step.json"
    args = ["--batch-sizes", "2", "--n", "2", "--max-new-tokens", "6", "--rounds", "1"]
    run_script("compiled_step.py", PROMPTS, *args, "--json", str(out), timeout=900)
    report = json.loads(out.read_text())
    assert report["startup"]["compiled"]["forward"] == "compiled"
    assert report["startup"]["eager"]["forward"] == "eager (--no-compile)"
    assert [(r["method"], r["same_tokens"]) for r in report["rows"]] == [("ar", 2), ("ragged", 2)]


def test_forward_profile(tmp_path):
    out = tmp_path / "profile.json"
    run_script(
        "forward_profile.py", "--rounds", "1", "--calls", "1", "--stream-mb", "64", "--json", str(out), timeout=900
    )
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"planned", "per layer"} and min(report["ms"].values()) > 0
    assert report["memory_floor_ms"] > 0 and report["weight_mb"] > 400  # the float32 target, tied head once
    assert all(p["products"] > 0 and p["attention kernels"] > 0 for p in report["profile_ms"].values())


@pytest.mark.skipif(not os.path.exists(PROMPTS), reason="the Spec-Bench prompts are not beside the checkout")
def test_planned_step(tmp_path):
    out = tmp_path / "planned.json"
    args = ["--batch-sizes", "2", "--methods", "ragged", "--n", "2", "--max-new-tokens", "6", "--rounds", "1"]
    run_script("planned_step.py", PROMPTS, *args, "--json", str(out), timeout=900)
    report = json.loads(out.read_text())
    assert [(r["method"], r["same_tokens"]) for r in report["rows"]] == [("ragged", 2)]
