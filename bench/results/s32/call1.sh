#!/usr/bin/env bash
# Session 32, call 1: where batch 1 goes now (llama3-8b FP8 and deepseek-v2-lite, kernels of one graph-timed step),
# then trtllm-1000 (llama3-8b FP8 + FP8 KV, default swap space) on the final tree of session 31.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== llama3-8b fp8 B=1 ctx 512 step, profile"
timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1 --context 512 \
  --profile base=PAGODA_PDL=1 2>&1 | tail -45
echo "== deepseek-v2-lite B=1 ctx 512 step, profile"
timeout 200 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 1 --context 512 \
  --profile base=PAGODA_PDL=1 2>&1 | tail -45
echo "== llama3-8b fp8 + fp8 kv, trtllm-1000 (default swap)"
timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 190 --out "$OUT/trtllm_default.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -4
python3 -c "import json; r = json.load(open('$OUT/trtllm_default.json'))['results'][0]; print({k: r.get(k) for k in ('output_tok_per_s', 'elapsed_s', 'num_preemptions', 'num_swapped', 'num_swap_blocks', 'load_s')})"
