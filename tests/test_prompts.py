"""Prompt files: Spec-Bench JSONL grouped by category (the measurement scripts' sample)."""

from __future__ import annotations

import json

from batchspec.tools.prompts import by_category


def test_by_category_keeps_file_order_and_caps_each(tmp_path):
    rows = [("math", "m1"), ("coding", "c1"), ("math", "m2"), ("math", "m3"), ("coding", "c2")]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"category": c, "turns": [t, "second turn"]}) + "\n" for c, t in rows))
    assert by_category(str(path), 2) == {"math": ["m1", "m2"], "coding": ["c1", "c2"]}
