#!/bin/bash
# What lost plans and results cost a served model: `pagoda serve` (SmolLM2 on the CPU, async scheduling unless
# ASYNC=0) with PAGODA_TEST_FAULTS dropping a share of the scheduler's plans and of the worker's results, under
# `pagoda bench serve` (32 requests of 64 tokens at concurrency 4). Prints one line: time, throughput, inter-token
# latency, and how many plans went again on the scheduler's timer and at once (a gap report, an early result or
# an idle acknowledgement).
#   bash bench/plan_loss.sh [SEED] [DROP] [PORT]      # defaults 1, 0.05, 8390; writes under ${OUT:-/tmp}/plan_loss
#   ASYNC=0 bash bench/plan_loss.sh ...                # serial steps (the CPU default)
set -euo pipefail
seed=${1:-1}
drop=${2:-0.05}
port=${3:-8390}
dir=${OUT:-/tmp}/plan_loss
mkdir -p "$dir"
python=${PYTHON:-.venv/bin/python}
model=${MODEL:-models/smollm2-135m-instruct}
OMP_NUM_THREADS=1 PAGODA_ASYNC_SCHEDULING=${ASYNC:-1} \
  PAGODA_TEST_FAULTS="plan=drop:$drop,seed:$seed;result=drop:$drop,seed:$((seed + 100))" \
  "$python" -m pagoda.cli serve --model "$model" --port "$port" --max-model-len 1024 > "$dir/server_$seed.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "localhost:$port/health" > /dev/null && break
  sleep 1  # polling an HTTP endpoint: there is nothing to wait on instead
done
"$python" -m pagoda.bench serve --url "http://127.0.0.1:$port" --concurrency 4 --num-prompts 32 --input-len 64 \
  --output-len 64 --rounds 8 --out "$dir/serve_$seed.json" > "$dir/serve_$seed.txt"
kill -TERM $server
wait $server || true
trap - EXIT
"$python" - "$dir" "$seed" <<'PY'
import json
import os
import sys

folder, seed = sys.argv[1], sys.argv[2]
level = json.load(open(f"{folder}/serve_{seed}.json"))["levels"][0]
log = open(f"{folder}/server_{seed}.log").read()
print(f"seed {seed} async {os.environ.get('ASYNC', '1')}: {level['num_requests']} requests, {level['num_failed']} failed, {level['elapsed_s']:.1f} s, "
      f"{level['output_tok_per_s']:.1f} out tok/s, ITL p50/p90/p99 {level['itl_p50_ms']:.0f}/"
      f"{level['itl_p90_ms']:.0f}/{level['itl_p99_ms']:.0f} ms, resends: timer "
      f"{log.count('to the workers (send')}, at once {log.count('to the workers at once')}")
PY
