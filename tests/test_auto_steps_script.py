"""experiments/auto_steps.py end to end on the tiny pair: both decoders run, every step of auto is
grouped, the groups account for every token auto generated."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_auto_steps_tiny(tmp_path):
    out = tmp_path / "steps.json"
    run_script(
        "auto_steps.py",
        "--pair",
        "tiny",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "12",
        "--rounds",
        "2",
        "--json",
        str(out),
    )
    rounds = json.loads(out.read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["tokens_per_s"]["ar"] > 0 and r["tokens_per_s"]["auto"] > 0
        groups = r["groups"]
        assert {g["kind"] for g in groups} <= {"plain", "verify"} and groups
        # 4 built-in prompts x 12 tokens, less the first token of each (prefill), less early EOS
        assert 0 < sum(g["tokens"] for g in groups) <= 4 * 11
        assert all(g["timed_vs_predicted"] > 0 and g["ms_per_step"] > 0 for g in groups)
