"""The training prompts: templates x topics from prompts.json, over the Spec-Bench categories (but
never the Spec-Bench prompts themselves).

Invariant: the prompts are a pure function of the seed of `rng` and the passages; every draw comes
from `rng`, in a fixed order (so a given seed always gives the same prompts).
"""

from __future__ import annotations

import json
import os
import random

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.json"), encoding="utf-8") as _f:
    DATA = json.load(_f)
LISTS, TEMPLATES = DATA["lists"], DATA["templates"]
FALLBACK_PASSAGE = "Anna met Tom in Berlin on 3 May 2021."  # extraction, when the target wrote no passages
EXTRACT_CHARS = 1200  # extraction quotes at most this much of a passage


def draw(spec: str | list[int], rng: random.Random):
    """One value of a slot: a list name draws from that list, [lo, hi] an integer in lo..hi."""
    if isinstance(spec, str):
        return rng.choice(LISTS[spec])
    return rng.randint(spec[0], spec[1])


def fill(template: str, rng: random.Random, category: str | None = None) -> str:
    """Fill every {slot} of `template`; all base slots are drawn, used or not (see prompts.json)."""
    values = {slot: draw(spec, rng) for slot, spec in DATA["slots"].items()}
    for slot, spec in DATA["category_slots"].get(category, {}).items():
        values[slot] = draw(spec, rng)
    for slot, spec in DATA["optional_slots"].items():
        if "{" + slot + "}" in template:
            values[slot] = draw(spec, rng)
    return template.format(**values)


def qa_prompt(rng: random.Random) -> str:
    """A short factual question; its one slot is filled from qa_fill."""
    template = rng.choice(TEMPLATES["qa"])
    slot = template.split("{")[1].split("}")[0]
    return template.format(**{slot: rng.choice(DATA["qa_fill"][slot])})


def translation_prompt(rng: random.Random) -> str:
    """Mostly German -> English (news style, sometimes two sentences), some French, Spanish, and English -> X."""
    kind = rng.random()
    if kind < 0.6:
        german = LISTS["german"]
        text = rng.choice(german) if rng.random() < 0.7 else " ".join(rng.sample(german, 2))
        return f"Translate German to English: {text}"
    if kind < 0.75:
        return f"Translate French to English: {rng.choice(LISTS['french'])}"
    if kind < 0.9:
        return f"Translate Spanish to English: {rng.choice(LISTS['spanish'])}"
    lang = rng.choice(["German", "French", "Spanish"])
    return f"Translate English to {lang}: {rng.choice(LISTS['english'])}"


def extraction_prompt(rng: random.Random, passages: list[str]) -> str:
    """An extraction task over a passage ({p}) or three numbered reviews ({reviews})."""
    template = rng.choice(TEMPLATES["extraction"])
    reviews = "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rng.sample(LISTS["review_bits"], 3)))
    passage = rng.choice(passages)[:EXTRACT_CHARS] if passages else FALLBACK_PASSAGE
    return template.format(p=passage, reviews=reviews)


def article_prompts() -> list[str]:
    """First pass: one request per article topic; the target's answers become the passages."""
    styles = TEMPLATES["articles"]
    return [styles[i % len(styles)].format(topic) for i, topic in enumerate(LISTS["article_topics"])]


def build_prompts(rng: random.Random, passages: list[str], scale: float = 1.0) -> list[tuple[str, str]]:
    """(category, prompt) pairs, category by category in prompts.json order; `scale` multiplies
    the counts (at least one prompt per category). `passages` must not be empty."""
    makers = {
        "extraction": lambda: extraction_prompt(rng, passages),
        "translation": lambda: translation_prompt(rng),
        "summarization": lambda: f"Summarize: {rng.choice(passages)}",
        "qa": lambda: qa_prompt(rng),
        "rag": lambda: f"{rng.choice(passages)}\n\n{rng.choice(TEMPLATES['rag'])}",
    }
    out = []
    for category, count in DATA["counts"].items():
        make = makers.get(category) or (lambda c=category: fill(rng.choice(TEMPLATES[c]), rng, c))
        out += [(category, make()) for _ in range(max(1, round(count * scale)))]
    return out
