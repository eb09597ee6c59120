"""The self-instruct corpus's pure parts: seeded meta-prompts over every kind, and the cleaning of
a generated request."""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts", "train_draft"))

import selfinstruct  # noqa: E402


def test_meta_prompts_are_seeded_and_cover_every_kind():
    n = 3 * len(selfinstruct.KINDS)
    a, b = selfinstruct.meta_prompts(random.Random(1), n), selfinstruct.meta_prompts(random.Random(1), n)
    assert a == b and len(a) == n
    assert a != selfinstruct.meta_prompts(random.Random(2), n)
    cats = [c for c, _ in a]
    assert {c: cats.count(c) for c in cats} == {c: 3 * [k for k, _ in selfinstruct.KINDS].count(c) for c in cats}
    assert all("{" not in p and p.startswith("Write ") for _, p in a)


def test_clean_keeps_the_request_only():
    assert selfinstruct.clean('Here is a request:\n"Write a poem about autumn leaves."') == (
        "Write a poem about autumn leaves."
    )
    assert selfinstruct.clean("  How do tides work on the other side of the Earth?  ") == (
        "How do tides work on the other side of the Earth?"
    )
    assert selfinstruct.clean("Hi") is None  # too short
    assert selfinstruct.clean("x" * (selfinstruct.MAX_CHARS + 1)) is None
