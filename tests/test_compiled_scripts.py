"""experiments/compiled_forward.py and experiments/compiled_step.py end to end on the default pair:
every variant is timed at every shape, and the compiled pair gives the eager pair's tokens."""

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
