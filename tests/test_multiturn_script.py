"""experiments/multiturn.py end to end on the tiny pair, briefly: two real servers (without and with
the prefix cache) answer the same chats; the cached one reuses the history's tokens."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_multiturn_tiny(tmp_path):
    out = tmp_path / "multiturn.json"
    args = ["--pair", "tiny", "--chats", "2", "--clients", "2", "--turns", "3", "--max-tokens", "8"]
    run_script("multiturn.py", *args, "--log", str(tmp_path / "server.log"), "--json", str(out), timeout=300)
    summary = json.loads(out.read_text())["summary"]
    assert summary["answers"] == 6 and summary["same_answers"] == 6
    assert summary["hit_tokens"] > 0 and len(summary["ttft_ratio"]) == 3
