#!/usr/bin/env bash
# `batchspec serve` beside `transformers serve --continuous-batching`, on the same weights (the
# default pair's GGUF as batchspec converts it: float32 safetensors, config, tokenizer), one server at
# a time, driven by a third-party load client: aiperf (NVIDIA), in a virtual environment of its own.
#
# Why aiperf: it runs offline with a local tokenizer, streams over the chat endpoint, reports TTFT,
# ITL (inter-chunk), TPOT (inter-token) and throughput with p50/p99, and sends only what it is told to
# (guidellm adds `ignore_eos`, which `transformers serve` rejects with 422).
#
# Servers: transformers (the peer), batchspec (its defaults), nospec (batchspec --no-spec), nocache
#   (batchspec --no-prefix-cache), nowindow (batchspec --arrival-window-ms 0), spin (batchspec --spin),
#   spinoff (batchspec --spin off), nogap (batchspec --max-itl-ms 0: a wave of prompts prefilled at once),
#   gapN (batchspec --max-itl-ms N), stepsN (batchspec --max-itl-steps N; steps0: the gap in ms alone),
#   and offline: not a server but `batchspec bench --methods ragged` at B = BATCH_SIZE on the same
#   Spec-Bench prompts (run at C = BATCH_SIZE only), the engine the server should keep up with.
# Workloads: specbench (16 Spec-Bench chat prompts, every 30th: real text, where lookup and the draft
#   head matter) and synthetic (aiperf's own random prompts of ISL tokens).
# Every request is greedy (temperature 0): transformers' continuous batching takes its sampling
# parameters from the first request, so only greedy compares like with like.
# Every (server, workload, C) point gets a freshly started server. Rounds alternate the servers' order (one server's speed drifts between runs on a shared machine).
#
# Usage: scripts/serve_compare.sh [OUT]            (default OUT: runs/serve_compare)
# Env: CONCURRENCY (1,2,4,8,16)  ROUNDS (1)  MAX_TOKENS (64)  ISL (256)  REQUESTS (16)
#      SERVERS (transformers,batchspec,nospec)  WORKLOADS (specbench,synthetic)  BATCH_SIZE (16)
#      AIPERF_VENV (.venv-aiperf, created with aiperf==0.13.0 if missing)  PY (.venv/bin/python)
# Then: python scripts/serve_report.py OUT   (tables and a plot)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/serve_compare}
PY=${PY:-.venv/bin/python}
bin=$(dirname "$PY")
venv=${AIPERF_VENV:-.venv-aiperf}
conc=${CONCURRENCY:-1,2,4,8,16}
rounds=${ROUNDS:-1}
max_tokens=${MAX_TOKENS:-64}
isl=${ISL:-256}
requests=${REQUESTS:-16}
servers=${SERVERS:-transformers,batchspec,nospec}
workloads=${WORKLOADS:-specbench,synthetic}
batch=${BATCH_SIZE:-16}
specbench=../shared/data/spec_bench/question.jsonl
mkdir -p "$out"

if [ ! -x "$venv/bin/aiperf" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'aiperf==0.13.0'
fi

# The same weights for every server: the directory batchspec reads the default pair's GGUF from.
weights=$(HF_HUB_OFFLINE=1 "$PY" - <<'EOF'

from batchspec.core import diskcache
from batchspec.models import pair as models
models.load_pair("default", dtype="float32")  # converts the GGUF once, if not done yet
print(diskcache.complete("models", models.gguf_name(models.smollm2_path())))
EOF
)
echo "weights: $weights"

"$PY" - "$specbench" "$requests" > "$out/specbench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for row in rows[::30][: int(sys.argv[2])]:
    print(json.dumps({"text": row["turns"][0]}))
EOF

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

batchspec_serve() {  # port log [options]: `batchspec serve` on the default pair at B = BATCH_SIZE, in the background
  local port=$1 log=$2
  shift 2
  HF_HUB_OFFLINE=1 "$bin/batchspec" serve --pair default --dtype float32 --batch-size "$batch" "$@" \
    --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
}

start() {  # start server $1 on port $2, logging to $3; prints its pid
  case $1 in
    transformers) HF_HUB_OFFLINE=1 "$bin/transformers" serve "$weights" --continuous-batching --device cpu \
                    --dtype float32 --host 127.0.0.1 --port "$2" >"$3" 2>&1 & ;;
    batchspec) batchspec_serve "$2" "$3" ;;
    nospec) batchspec_serve "$2" "$3" --no-spec ;;
    nocache) batchspec_serve "$2" "$3" --no-prefix-cache ;;
    nowindow) batchspec_serve "$2" "$3" --arrival-window-ms 0 ;;
    spin) batchspec_serve "$2" "$3" --spin ;;
    spinoff) batchspec_serve "$2" "$3" --spin off ;;
    nogap) batchspec_serve "$2" "$3" --max-itl-ms 0 ;;
    gap[0-9]*) batchspec_serve "$2" "$3" --max-itl-ms "${1#gap}" ;;
    steps[0-9]*) batchspec_serve "$2" "$3" --max-itl-steps "${1#steps}" ;;
    *) echo "unknown server $1" >&2; exit 2 ;;
  esac
  echo $!
}

model_of() { if [ "$1" = transformers ]; then echo "$weights"; else echo default; fi; }

profile() {  # server port workload C dir
  local data=(--input-file "$out/specbench.jsonl" --custom-dataset-type single_turn)
  if [ "$3" = synthetic ]; then
    data=(--prompt-input-tokens-mean "$isl" --prompt-input-tokens-stddev 0 --random-seed 7)
  fi
  env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$venv/bin/aiperf" profile --model "$(model_of "$1")" \
    --tokenizer "$weights" --url "http://127.0.0.1:$2" --endpoint-type chat --streaming \
    --use-legacy-max-tokens --use-server-token-count --extra-inputs temperature:0 \
    --prompt-output-tokens-mean "$max_tokens" --prompt-output-tokens-stddev 0 \
    --concurrency "$4" --request-count "$(( requests > $4 ? requests : $4 ))" --warmup-request-count 1 \
    "${data[@]}" --output-artifact-dir "$5" --no-server-metrics --no-gpu-telemetry --no-auto-plot --export-level records \
    >"$5.log" 2>&1 || { echo "aiperf failed: $5.log" >&2; tail -5 "$5.log" >&2; }
}

IFS=, read -ra server_list <<<"$servers"
IFS=, read -ra workload_list <<<"$workloads"
IFS=, read -ra conc_list <<<"$conc"
for ((r = 0; r < rounds; r++)); do
  order=("${server_list[@]}")
  if ((r % 2 == 1)); then
    order=(); for ((i = ${#server_list[@]} - 1; i >= 0; i--)); do order+=("${server_list[$i]}"); done
  fi
  for s in "${order[@]}"; do
    if [ "$s" = offline ]; then
      dir="$out/r$r/offline/specbench/c$batch"; mkdir -p "$dir"
      HF_HUB_OFFLINE=1 "$bin/batchspec" bench --pair default --dtype float32 --methods ragged --batch-sizes "$batch" \
        --prompts "$specbench" --every 30 --limit "$requests" --max-new-tokens "$max_tokens" --repeats 1 \
        --json "$dir/offline.json" >"$dir.log" 2>&1 || { echo "offline bench failed: $dir.log" >&2; continue; }
      echo "  offline      specbench C=$batch: $("$PY" -c "import json,sys; print(round(json.load(open(sys.argv[1]))['runs'][0]['tokens_per_s'], 3))" "$dir/offline.json") tok/s"
      continue
    fi
    for w in "${workload_list[@]}"; do
      for c in "${conc_list[@]}"; do
        # A fresh server for every point: one process serving C = 1, 2, ... in turn would start the
        # later points' repeated prompts from its prefix cache (and the peer from a warmer state).
        port=$(free_port); log="$out/r$r-$s-$w-c$c.server.log"
        t0=$(date +%s%N)
        pid=$(start "$s" "$port" "$log")
        until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 || curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; do
          kill -0 "$pid" 2>/dev/null || { echo "$s exited:" >&2; tail -20 "$log" >&2; exit 1; }
          sleep 1
        done
        echo "r$r $s $w C=$c: ready in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
        dir="$out/r$r/$s/$w/c$c"; mkdir -p "$(dirname "$dir")"
        profile "$s" "$port" "$w" "$c" "$dir"
        "$PY" - "$dir/profile_export_aiperf.json" "$s" "$w" "$c" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
g = lambda k, s="avg": round(d[k][s], 3) if k in d and d[k].get(s) is not None else None
print(f"  {sys.argv[2]:12s} {sys.argv[3]:9s} C={sys.argv[4]:>2s}: {g('output_token_throughput'):8} tok/s  "
      f"TTFT p50 {g('time_to_first_token', 'p50')} ms  ITL p50 {g('inter_chunk_latency', 'p50')} ms  "
      f"errors {d.get('error_summary') or 0}")
EOF
        kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
      done
    done
  done
done
echo "done: $out (report: $PY scripts/serve_report.py $out)"
