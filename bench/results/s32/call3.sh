#!/usr/bin/env bash
# Session 32, call 3: issue 25's FP8-against-bf16 sweep with the committed table (llama3-8b shapes, every M bucket),
# deepseek-v2-lite reference + batch-1 (issue 20), a second trtllm-1000 run on this tree, and the engine load time
# with the swap pool registered (cudaHostRegister) against none.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
echo "== fp8 sweep against bf16, committed table"
timeout 240 python3 -m pagoda.bench.fp8_tune --skip-tune --shapes llama3-8b --out "$OUT/sweep" 2>&1 | tail -60
echo "== deepseek-v2-lite reference + batch-1"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --timeout 190 --out "$OUT/deepseek-v2-lite.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -5
echo "== llama3-8b fp8 + fp8 kv, trtllm-1000 (default swap)"
timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 190 --out "$OUT/trtllm_default.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -4
python3 -c "import json; r = json.load(open('$OUT/trtllm_default.json'))['results'][0]; print({k: r.get(k) for k in ('output_tok_per_s', 'elapsed_s', 'num_preemptions', 'num_swapped', 'decode_steps', 'mixed_steps_gpu_s', 'decode_steps_gpu_s', 'load_s')})"
echo "== engine load with the swap pool page-locked by cudaHostRegister (warm compile cache), then without a pool"
for swap in 16 0; do timeout 100 python3 bench/results/s32/load_probe.py $swap 2>&1 | grep swap_space; done
