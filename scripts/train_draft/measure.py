"""Measurement with the package itself, on Spec-Bench (used here only, never for training):
acceptance at k per category and overall, exactness against `reference`, and the draft/target
cost ratio of one forward. Everything float32, greedy, on the CPU, with the weights at args.out."""

from __future__ import annotations

import logging
import statistics

import torch

from batchspec import SamplingParams, SpecDecoder
from batchspec.models.draft import load_default_draft
from batchspec.models.pair import load_pair
from batchspec.tools.costs import forward_seconds
from batchspec.tools.prompts import by_category

LOG = logging.getLogger("train_draft")


def cost_ratio(target, draft, context: int = 300, repeats: int = 25) -> dict:
    """Median time of one forward at batch 1, one new token over `context` cached ones."""
    t_target = forward_seconds(target, 1, 1, context, repeats)
    t_draft = forward_seconds(draft, 1, 1, context, repeats)
    return {
        "target_ms": round(t_target * 1e3, 2),
        "draft_ms": round(t_draft * 1e3, 2),
        "ratio": round(t_draft / t_target, 4),
    }


def measure(args) -> dict:
    """The "specbench" entry of the weights' JSON."""
    pair = load_pair(args.pair, dtype="float32", device="cpu")
    pair.draft = load_default_draft(pair.target, torch.float32, path=args.out)
    pair.draft_vocab_ids = pair.draft.vocab_ids
    params = SamplingParams(max_new_tokens=args.eval_tokens)
    spec = SpecDecoder(pair, method="spec1", k=args.k, proposer="draft")
    result = {"k": args.k, "max_new_tokens": args.eval_tokens, "per_category": {}, "spec1_tokens_per_s": {}}
    hist: dict[str, int] = {}
    first = {}  # category -> (its first prompt, spec1's tokens for it)
    for cat, prompts in by_category(args.eval_specbench, args.eval_per_category).items():
        outs = spec.generate(prompts, params)
        summary = spec.stats.summary()
        result["per_category"][cat] = round(summary["mean_accepted"], 3)
        result["spec1_tokens_per_s"][cat] = round(summary["tokens_per_s"], 2)
        for a, n in summary["accepted_histogram"].items():
            hist[a] = hist.get(a, 0) + n
        first[cat] = (prompts[0], outs[0].token_ids)
        LOG.info(f"spec-bench {cat}: mean accepted {summary['mean_accepted']:.2f}, {summary['tokens_per_s']:.1f} tok/s")
    steps = sum(hist.values())
    result["overall"] = round(sum(int(a) * n for a, n in hist.items()) / max(steps, 1), 3)  # over all steps
    result["mean_of_categories"] = round(statistics.mean(result["per_category"].values()), 3)
    result["accepted_histogram"] = dict(sorted(hist.items()))
    # Exactness: greedy speculative decoding must equal the target alone, token for token.
    cats = list(first)[: args.eval_exact]
    ref = SpecDecoder(pair, method="reference")
    ref_outs = ref.generate([first[c][0] for c in cats], params)
    result["exact_vs_reference"] = {c: o.token_ids == first[c][1] for c, o in zip(cats, ref_outs)}
    result["reference_tokens_per_s"] = round(ref.stats.summary()["tokens_per_s"], 2)
    spec_again = SpecDecoder(pair, method="spec1", k=args.k, proposer="draft")
    spec_again.generate([first[c][0] for c in cats], params)
    result["spec1_tokens_per_s_same_prompts"] = round(spec_again.stats.summary()["tokens_per_s"], 2)
    LOG.info(f"exact vs reference: {result['exact_vs_reference']}")
    result["cost"] = cost_ratio(pair.target, pair.draft)
    LOG.info(f"cost: {result['cost']}")
    return result
