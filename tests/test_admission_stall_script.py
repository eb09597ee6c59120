"""experiments/admission_stall.py end to end on the tiny pair: every run decodes all rows, the late
long prompt is prefilled whole when unchunked and over several iterations when chunked."""

from __future__ import annotations

import json

import pytest
from helpers import run_script

pytestmark = pytest.mark.scripts  # a measurement script's test: on demand


def test_admission_stall_tiny(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([f"short prompt number {i}" for i in range(8)] + ["a long one " * 60]) + "\n")
    out = tmp_path / "stall.json"
    run_script("admission_stall.py", "--pair", "tiny", "--prompts", str(prompts), "--json", str(out))
    report = json.loads(out.read_text())
    assert report["long_prompt_tokens"] == max(report["short_prompt_tokens"] + [report["long_prompt_tokens"]])
    whole, chunked = report["whole prompt at once"], report["chunk 128"]
    # a chunk of at most 128 prompt tokens per iteration
    assert sum(r["chunked"] for r in chunked["timeline"]) >= report["long_prompt_tokens"] // 128 >= 5
    assert sum(r["chunked"] for r in whole["timeline"]) == 0  # one prefill of the whole prompt
    for run_ in (whole, chunked, report["measured chunk"]):
        assert max(r["rows"] for r in run_["timeline"]) == 9  # the late prompt joined the 8 rows
