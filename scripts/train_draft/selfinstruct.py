"""A second corpus: the target writes the requests itself, then answers them (self-instruct).

The templated prompts (corpus.py) vary little in wording, and a head trained on them alone
generalises poorly to other users' requests. Here, pass 1 asks the target, sampling, for one
request of a given kind about a drawn topic (kinds over the Spec-Bench categories, never its
prompts); pass 2 has it answer every usable request (mostly greedy). Both passes are training data.

Invariant: a pure function of the seed (every draw from seeded generators, in a fixed order).
"""

from __future__ import annotations

import logging
import os
import random
import time

import answers
import corpus
import torch

from batchspec.models.pair import load_pair

LOG = logging.getLogger("train_draft")
#: (category, what to ask for); {slots} are filled from prompts.json's lists by corpus.fill.
KINDS = [
    ("writing", "a creative writing request (a story, a poem, a letter, a speech or a blog post) about {t}"),
    ("writing", "a request to rewrite, shorten or improve a short paragraph about {t}, including the paragraph"),
    ("roleplay", "a role-play request in which the user asks the assistant to act as a {r} and talk about {t}"),
    ("reasoning", "a logic puzzle or riddle that needs careful step-by-step reasoning"),
    ("reasoning", "a question asking to compare two options related to {t} and recommend one"),
    ("math", "a math problem (algebra, geometry, probability or number theory) with concrete numbers"),
    ("coding", "a programming task: write a function in Python, JavaScript, C++ or SQL that {task}"),
    ("coding", "a question about a programming concept (for example recursion, classes or hash tables)"),
    ("stem", "a science or engineering question about {s}"),
    ("humanities", "an essay question about {h}"),
    ("humanities", "a question about economics, philosophy, law or psychology related to {t}"),
    ("qa", "a short factual question about {t} with a one-sentence answer"),
    ("math_reasoning", "a grade-school math word problem about {n1} and some {it}"),
    (
        "translation",
        "a request to translate two or three sentences about {t} from English into French, German or Spanish, "
        "including the sentences",
    ),
    ("summarization", "a request to summarize a short paragraph about {t}, including the paragraph"),
    (
        "extraction",
        "a request to extract names, dates and numbers from a short news paragraph about {t}, including the paragraph",
    ),
]
META = "Write {kind}. Reply with the request only, exactly as a user would type it, nothing else."
MIN_CHARS, MAX_CHARS = 20, 800  # generated requests outside these lengths are dropped


def meta_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n (category, meta-prompt) items: KINDS over and over, each round in a seeded order."""
    kinds: list[tuple[str, str]] = []
    while len(kinds) < n:
        cycle = list(KINDS)
        rng.shuffle(cycle)
        kinds += cycle
    return [(cat, META.format(kind=corpus.fill(kind, rng, cat))) for cat, kind in kinds[:n]]


def clean(text: str) -> str | None:
    """The request in a generated reply: an opening 'Here is ...:' line and quotes dropped."""
    text = text.strip()
    first, _, rest = text.partition("\n")
    if rest and first.rstrip().endswith(":") and len(first) < 80:
        text = rest.strip()
    text = text.strip('"').strip()
    return text if MIN_CHARS <= len(text) <= MAX_CHARS else None


def build(args) -> dict:
    """Both passes; cached to args.self_data (a re-run loads the cache)."""
    if os.path.exists(args.self_data):
        LOG.info(f"loading cached self-instruct data from {args.self_data}")
        return torch.load(args.self_data)
    start = time.time()
    pair = load_pair(args.pair, dtype=args.gen_dtype, device="cpu")
    rng = random.Random(args.seed + 10)
    metas = meta_prompts(rng, args.self_instruct)
    asked = answers.answer_all(pair, metas, args.seed + 11, args.request_tokens, (1.0, 0.8), args.gen_batch)
    requests = [clean(pair.decode(r["tokens"][r["n_prompt"] :].tolist())) for r in asked]
    items = [(cat, req) for (cat, _), req in zip(metas, requests) if req is not None]
    LOG.info(f"self-instruct: {len(items)} of {len(metas)} generated requests kept")
    sample = (args.sample_frac, args.sample_temp)
    records = asked + answers.answer_all(pair, items, args.seed + 12, args.max_new_tokens, sample, args.gen_batch)
    data = {"records": records, "requests": [t for _, t in items], "gen_s": time.time() - start}
    os.makedirs(os.path.dirname(os.path.abspath(args.self_data)), exist_ok=True)
    torch.save(data, args.self_data)
    LOG.info(f"saved {len(records)} sequences to {args.self_data}")
    return data
