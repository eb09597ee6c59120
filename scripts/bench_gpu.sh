#!/usr/bin/env bash
# The benchmark of docs/benchmarks.md on a CUDA GPU: bfloat16, larger batch sizes.
# Usage: scripts/bench_gpu.sh [OUT_DIR]   (needs a CUDA build of torch in the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu}"
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU machine')"
prompts="${BATCHSPEC_PROMPTS:-../shared/data/spec_bench/question.jsonl}"
python -m batchspec.cli bench --pair default --device cuda --dtype bfloat16 \
  --methods ar,spec1,eqspec,exspec,ragged --batch-sizes 1,4,8,16,32 \
  --prompts "$prompts" --every 5 --limit 96 --max-new-tokens 128 -k 4 --repeats 2 \
  --json "$out/bench.json" --plot "$out/bench.png"
