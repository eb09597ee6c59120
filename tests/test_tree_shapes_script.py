"""experiments/tree_shapes.py end to end on the tiny pair: the offline count of the full beam equals
what the decoder measured, and a larger column budget never yields less."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_tree_shapes_tiny(tmp_path):
    prompts = tmp_path / "q.jsonl"
    rows = [{"category": cat, "turns": [f"{cat} question number {i}: tell me more"]} for cat in "ab" for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "shapes.json"
    argv = ["--pair", "tiny", "--prompts", str(prompts), "--proposer", "eagle", "--branches", "3", "-k", "3"]
    run_script("tree_shapes.py", *argv, "--max-new-tokens", "16", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["steps"] > 10
    assert result["full_beam"]["offline"] == result["full_beam"]["decoder"]
    best = result["best_by_columns"]
    assert [b["columns"] for b in best] == list(range(2, 2 + 3 * 3))
    rates = [b["tokens_per_step"] for b in best]
    assert rates == sorted(rates) and rates[-1] > 1.0  # a node more never yields less; the beam accepts some
    assert best[-1]["widths"] == "3x3x3" and best[0]["widths"] == "1"
