"""The tiny pair is a test instrument: it must be non-degenerate (a test on repetitive output
cannot see a wrong position or mask) and give mixed acceptance."""

from __future__ import annotations

import torch
from helpers import random_prompts

from batchspec import SamplingParams, SpecDecoder


def test_output_is_varied(tiny32):
    outs = SpecDecoder(tiny32, method="reference").generate(
        random_prompts(10, 5, 1, 20), SamplingParams(max_new_tokens=40, ignore_eos=True)
    )
    for o in outs:
        assert len(set(o.token_ids)) >= 20, f"degenerate output: {o.token_ids}"


@torch.inference_mode()
def test_output_depends_on_positions(tiny32):
    """A one-position gap in the middle (what a hole left by a rejected draft does to positions
    taken from the padded column) changes the next-token argmax. (RoPE is relative: a uniform
    shift of every position changes nothing, so the gap is the bug class that matters.)"""
    model = tiny32.target
    changed = 0
    prompts = random_prompts(11, 20, 8, 40)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        n, mid = len(prompt), len(prompt) // 2
        gap = torch.cat([torch.arange(mid), torch.arange(mid + 1, n + 1)])[None]
        right = model(input_ids=ids, position_ids=torch.arange(n)[None]).logits[0, -1].argmax()
        wrong = model(input_ids=ids, position_ids=gap).logits[0, -1].argmax()
        changed += int(right != wrong)
    assert changed >= len(prompts) // 4, f"only {changed} of {len(prompts)} next tokens moved"


def test_acceptance_is_mixed(tiny64):
    dec = SpecDecoder(tiny64, method="eqspec", k=4, batch_size=8)
    dec.generate(random_prompts(12, 16, 1, 40), SamplingParams(max_new_tokens=48, ignore_eos=True))
    hist = dec.stats.accepted_hist
    total = sum(hist.values())
    assert all(hist[a] > 0 for a in range(5)), f"every accepted count 0..k should occur: {dict(hist)}"
    assert 0.1 < dec.stats.summary()["mean_accepted"] / 4 < 0.9
    assert hist[0] < 0.6 * total and hist[4] < 0.6 * total


def test_tokenizer_round_trips_text(tiny32):
    text = "Speculative décodage — 123"
    ids = tiny32.encode(text)
    assert tiny32.decode(ids) == text
