"""experiments/copy_ops.py end to end: every operation, dtype and shape is timed in both forms, and the
script's own check (the engine's form gives the plain form's result) passes on bfloat16 and float32."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_copy_ops(tmp_path):
    out = tmp_path / "ops.json"
    run_script("copy_ops.py", "--dtypes", "bfloat16,float32", "--calls", "2", "--json", str(out))
    rows = json.loads(out.read_text())
    assert {(r["op"], r["dtype"]) for r in rows} == {
        (op, dtype) for op in ("slot write", "greedy pick") for dtype in ("bfloat16", "float32")
    }
    assert len(rows) == 2 * (5 + 4)
    assert all(r["plain_us"] > 0 and r["engine_us"] > 0 for r in rows)
