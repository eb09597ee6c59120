"""Reading prompt files: Spec-Bench JSONL (the first element of `turns`, plus its `category`),
JSONL with a `prompt` field, or plain text with one prompt per line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..core.errors import BatchspecError


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str | None = None


def read_prompts(path: str, limit: int | None = None, every: int = 1) -> list[Prompt]:
    """Prompts from `path`, in file order: every `every`-th one, at most `limit` of them."""
    if not os.path.isfile(path):
        raise BatchspecError(f"prompt file not found: {path}")
    if limit is not None and limit < 1:
        raise BatchspecError(f"--limit must be >= 1, got {limit}")
    if every < 1:
        raise BatchspecError(f"--every must be >= 1, got {every}")
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    jsonl = path.endswith(".jsonl") or (lines and lines[0].lstrip().startswith("{"))
    prompts = []
    rows = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    for number, line in rows[::every]:
        prompts.append(_parse_json(line, path, number) if jsonl else Prompt(line))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise BatchspecError(f"no prompts in {path}")
    return prompts


def by_category(path: str, per_category: int) -> dict[str, list[str]]:
    """The first `per_category` prompt texts of every category, in file order ("all" without one)."""
    out: dict[str, list[str]] = {}
    for prompt in read_prompts(path):
        bucket = out.setdefault(prompt.category or "all", [])
        if len(bucket) < per_category:
            bucket.append(prompt.text)
    return out


def _parse_json(line: str, path: str, number: int) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise BatchspecError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    if isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]:
        return Prompt(str(row["turns"][0]), row.get("category"))
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return Prompt(row["prompt"], row.get("category"))
    raise BatchspecError(f"{path}:{number}: expected a Spec-Bench row with 'turns' or a row with 'prompt'")
