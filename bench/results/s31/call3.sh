#!/usr/bin/env bash
# Session 31, call 3: load time with the pinned pool allocated on a thread before the KV cache, then trtllm-1000
# with the default swap space on that tree.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
for swap in 0 16; do timeout 100 python3 bench/results/s31/load_probe.py $swap 2>&1 | grep swap_space; done
timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 190 --out "$OUT/trtllm_default.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -4
python3 -c "import json; r = json.load(open('$OUT/trtllm_default.json'))['results'][0]; print({k: r.get(k) for k in ('output_tok_per_s', 'elapsed_s', 'num_preemptions', 'num_swapped', 'num_swap_blocks', 'load_s')})"
