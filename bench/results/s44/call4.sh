#!/usr/bin/env bash
# Session 44, call 4 (~580 s of device time left). On an H200 only: llama3-8b FP8 batch-1 and deepseek-v2-lite
# reference + batch-1 (the retune of o at 64 / 128 rows does not fit the budget left). Another card stops.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
[[ $card == *H200* ]] || exit 0
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 \
  --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
timeout 110 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --timeout 100 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -5
echo "== done [$(( $(date +%s) - start )) s]"
