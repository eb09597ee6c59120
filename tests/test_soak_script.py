"""scripts/soak.py end to end on the tiny pair, briefly: a real server under mixed load with dropped
streams and bursts past its queue bound; greedy answers equal the reference, seeded ones repeat,
the server goes back to idle with every KV slot freed, and bursts are shed with 429, never 5xx.
(The memory check needs a longer run than a test affords; docs/serving.md has one.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_soak_tiny(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "HF_HUB_OFFLINE": "1"}
    args = ["--pair", "tiny", "--duration", "20", "--clients", "4", "--batch-size", "4", "--max-queue", "2"]
    args += ["--burst-every", "8", "--check", "8", "--log", str(tmp_path / "server.log"), "--json", str(out)]
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "soak.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.exists(), run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    for name in ("idle", "idle_again", "seeded", "greedy", "no_5xx", "shedding"):
        assert checks[name]["ok"], (name, checks[name], report["error_samples"])
    assert checks["greedy"]["checked"] >= 4 and checks["seeded"]["checked"] >= 4
    assert report["requests"]["dropped"] >= 1 and report["requests"]["ok"] >= 20
