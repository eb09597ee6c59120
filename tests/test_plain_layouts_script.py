"""experiments/plain_layouts.py end to end on the default pair: both layouts of `ar` timed at every
batch size, with the same tokens."""

from __future__ import annotations

import json
import os

import pytest
from helpers import ROOT, run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand

PROMPTS = os.path.join(ROOT, "..", "shared", "data", "spec_bench", "question.jsonl")


@pytest.mark.skipif(not os.path.exists(PROMPTS), reason="the Spec-Bench prompts are not beside the checkout")
def test_plain_layouts(tmp_path):
    out = tmp_path / "layouts.json"
    args = ["--batch-sizes", "1,3", "--n", "4", "--max-new-tokens", "6", "--rounds", "2"]
    run_script("plain_layouts.py", PROMPTS, *args, "--json", str(out), timeout=900)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for row in rows:
        assert row["same_tokens"] == 4
        assert all(len(v) == 2 and min(v) > 0 for v in row["tok_s"].values())
