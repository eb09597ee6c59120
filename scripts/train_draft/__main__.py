"""Train the shipped draft model for SmolLM2-135M-Instruct, from scratch to the weights file.

    python scripts/train_draft                     # everything, default settings (~50 min on 2 CPU cores)
    python scripts/train_draft --data-only         # stop once the data is cached
    python scripts/train_draft --eval-specbench /work/shared/data/spec_bench/question.jsonl

Pipeline (one module each, in this folder):
  1. prompts  - corpus.py + prompts.json: templates x topics over the Spec-Bench categories (never
                the Spec-Bench prompts themselves); passages for summarisation and context QA are
                written by the target itself in a first generation pass.
  2. data     - answers.py: the target answers every prompt (greedy mostly, some sampled) with the
                chat template; its final hidden states are kept. Cached to --data (a re-run skips it).
  3. vocab    - vocab.py: the V_r most frequent tokens of the data (EOS and chat tokens forced in).
  4. distil   - distill.py: N Llama layers initialised from target layers, final norm and head rows
                from the target; loss = KL(target || draft) over the reduced vocabulary + a CE on the
                target's (reduced) argmax; AdamW, cosine schedule. validate.py: held-out agreement.
  5. save     - pipeline.py: src/batchspec/weights/smollm2_draft.{safetensors,json} by default
                (bf16; the embedding is the target's and is not stored).
  6. measure  - measure.py, with --eval-specbench: acceptance at k with the package's own engine on
                5 Spec-Bench prompts per category, exactness vs `reference`, draft/target cost ratio.

`--pair tiny` runs the same pipeline on the built-in tiny pair (seconds; for tests).
"""

from __future__ import annotations

import os

# Threads that wait passively: with active spinning, two processes sharing these 2 cores slow each
# other down more than tenfold. Must be set before torch starts its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import logging
import random
import sys

import measure
import pipeline
import torch

from batchspec.models.draft import DRAFT_FILE
from batchspec.models.pair import cpu_has_bf16

LOG = logging.getLogger("train_draft")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python scripts/train_draft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--pair", default="default", choices=("default", "tiny"), help="built-in target (and tokenizer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--data", default="/tmp/batchspec_draft/data.pt", help="cache of the generated data")
    ap.add_argument("--data-only", action="store_true", help="stop once the data is cached")
    ap.add_argument("--out", default=DRAFT_FILE, help="weights file (the JSON goes next to it)")
    g = ap.add_argument_group("data generation")
    g.add_argument("--prompt-scale", type=float, default=1.2, help="multiplies the prompts per category")
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--article-tokens", type=int, default=360, help="length of the passages the target writes")
    g.add_argument("--gen-batch", type=int, default=32)
    g.add_argument("--gen-dtype", default="float32", choices=("float32", "bfloat16"), help="the target's, generating")
    g.add_argument("--sample-frac", type=float, default=0.2, help="share of answers sampled instead of greedy")
    g.add_argument("--sample-temp", type=float, default=0.7)
    g = ap.add_argument_group("draft and training")
    g.add_argument("--init-layers", default="0,1", help="target layers copied into the draft, 'r': random (N = count)")
    g.add_argument("--vocab", type=int, default=8192, help="V_r, size of the reduced head")
    g.add_argument("--steps", type=int, default=1500)
    g.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
    g.add_argument("--max-len", type=int, default=1024)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--ce-weight", type=float, default=0.3, help="weight of the CE on the target's argmax")
    g.add_argument("--prompt-weight", type=float, default=1.0, help="loss weight of prompt positions")
    g.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: if the CPU has bf16)",
    )
    g.add_argument("--val-frac", type=float, default=0.04)
    g.add_argument("--eval-every", type=int, default=300)
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--k", type=int, default=4)
    g = ap.add_argument_group("measurement (Spec-Bench; evaluation only)")
    g.add_argument("--eval-specbench", default=None, help="Spec-Bench question.jsonl; measure after saving")
    g.add_argument("--eval-only", action="store_true", help="only measure the weights at --out")
    g.add_argument("--eval-per-category", type=int, default=5)
    g.add_argument("--eval-tokens", type=int, default=64)
    g.add_argument("--eval-exact", type=int, default=13, help="prompts checked against `reference`")
    args = ap.parse_args(argv)
    args.bf16 = cpu_has_bf16() if args.bf16 is None else args.bf16
    args.command = " ".join(["python scripts/train_draft", *argv])
    return args


class Elapsed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"[{record.relativeCreated / 1e3:7.1f}s] {record.getMessage()}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not LOG.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(Elapsed())
        LOG.addHandler(handler)
        LOG.setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if not args.eval_only:
        pipeline.run_training(args)
        if args.data_only:
            return
    if args.eval_specbench:
        result = measure.measure(args)
        meta_file = pipeline.meta_path(args.out)
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        meta["specbench"] = result
        with open(meta_file, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        LOG.info(f"Spec-Bench: overall mean accepted {result['overall']}, per category {result['per_category']}")


if __name__ == "__main__":
    main()
