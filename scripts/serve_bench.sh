#!/usr/bin/env bash
# Load-test `batchspec serve` on the default pair: speculation (ragged, n-gram proposer, k=4) and
# plain decoding (--no-spec: the same engine with k = 0), at 1, 4 and 16 concurrent clients.
# One server at a time; results in docs/serving/*.json. Usage: scripts/serve_bench.sh [requests] [max_tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-16}; max_tokens=${2:-64}; port=${PORT:-8431}
mkdir -p docs/serving
for mode in spec plain; do
  opts="--proposer ngram -k 4"; [ "$mode" = plain ] && opts="--no-spec"
  python -m batchspec.cli serve --pair default --batch-size 16 --kv-budget 16384 --port "$port" $opts &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
  for c in 1 4 16; do
    python scripts/load_test.py --url "http://127.0.0.1:$port" --concurrency "$c" --requests "$requests" \
      --max-tokens "$max_tokens" --json "docs/serving/${mode}_c${c}.json" >/dev/null
    echo "$mode c=$c: $(python -c "import json;r=json.load(open('docs/serving/${mode}_c${c}.json'));print(r['throughput_tok_s'],'tok/s', r['ttft_ms'], r['itl_ms'], r['errors'],'errors')")"
  done
  kill -TERM "$pid"; wait "$pid"
done
