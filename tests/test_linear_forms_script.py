"""experiments/linear_forms.py end to end on the tiny pair: one row per shape, both arms timed; the
sweep mode times every formulation per row count."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_linear_forms_tiny(tmp_path):
    out = tmp_path / "forms.json"
    run_script(
        "linear_forms.py",
        "--pair",
        "tiny",
        "--batch-sizes",
        "1,2",
        "--widths",
        "1,3",
        "--rounds",
        "1",
        "--json",
        str(out),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["B"], r["q"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["F.linear_ms"] > 0 and r["tuned_ms"] > 0 for r in rows)
    assert {r["form"] for r in rows} <= {"plain", "transposed", "onednn"}


def test_linear_forms_sweep_tiny(tmp_path):
    out = tmp_path / "sweep.json"
    run_script("linear_forms.py", "--pair", "tiny", "--sweep", "1,5,40", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["M"] for r in rows] == [1, 5, 40]
    assert all(r["plain_ms"] > 0 and r["transposed_ms"] > 0 for r in rows)  # oneDNN where the build has it
