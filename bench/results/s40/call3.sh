#!/usr/bin/env bash
# Session 40, call 3. On an H200 (rarely lent): issue 25's two dense cells (llama3-8b o at 64 / 128 rows, FP8 0.95x /
# 0.85x of bf16 in the thirty-second session) retuned on the H200 with the norm after it, then swept (commit
# $OUT/tune_o/w8a16_table.json as kernels/fp8_configs/ if FP8 >= bf16 everywhere); then the issue figures on this
# tree as time allows: deepseek-v2-lite reference + batch-1, llama3-8b FP8 batch-1, trtllm-1000.
# On any other card: the served A/B of call 2 (bench/results/s40/call2.sh).
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ $card != *H200* ]]; then
  echo "card: $card, not an H200: the served A/B (call2.sh)"
  exec bash bench/results/s40/call2.sh
fi
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
timeout 200 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
  2>&1 | grep -E "^(precompiled|tune|sweep|FP8|o )" | cut -c1-240
echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
timeout 160 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --timeout 150 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -5
if (( $(date +%s) - start < 330 )); then
  echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
  timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 190 \
    --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
fi
if (( $(date +%s) - start < 380 )); then
  echo "== llama3-8b fp8 + fp8 kv, trtllm-1000 [$(( $(date +%s) - start )) s]"
  timeout $(( 580 - ($(date +%s) - start) )) python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy \
    --quantization fp8 --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 180 --out "$OUT/figures_trtllm-1000.json" \
    2>&1 | grep -v "^[a-z-]*: {" | tail -4
fi
echo "== done [$(( $(date +%s) - start )) s]"
