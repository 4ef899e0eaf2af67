#!/usr/bin/env bash
# Session 32, call 2: L2 prefetch of the next weights on a side stream during batch-1 attention (kernels/l2_prefetch.py):
# its GPU test, step A/B (graph-timed, logits compared) on llama3-8b FP8 / bf16 and deepseek-v2-lite, then the FP8
# batch-1 figure end to end with it on.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_l2_prefetch.py -m gpu -rf --tb=short \
  2>&1 | tail -15
V=(off=PAGODA_L2_PREFETCH=0 "o=PAGODA_L2_PREFETCH=lines;PAGODA_L2_PREFETCH_MB=0"
   "l16=PAGODA_L2_PREFETCH=lines;PAGODA_L2_PREFETCH_MB=16" "l32=PAGODA_L2_PREFETCH=lines;PAGODA_L2_PREFETCH_MB=32"
   "b16=PAGODA_L2_PREFETCH=bulk;PAGODA_L2_PREFETCH_MB=16")
echo "== llama3-8b fp8 (steps of <= 8 tokens prefetch)"
PAGODA_L2_PREFETCH_TOKENS=8 timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 \
  --batches 1,2,8 --context 512 "${V[@]}" 2>&1 | grep "ctx"
echo "== deepseek-v2-lite"
timeout 200 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 1 --context 512 "${V[@]}" \
  2>&1 | grep "ctx"
echo "== llama3-8b bf16"
timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --batches 1 --context 512 "${V[@]:0:3}" 2>&1 | grep "ctx"
echo "== llama3-8b fp8 B=1 kernels, off and l16"
timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1 --context 512 --profile \
  --rounds 1 "${V[0]}" "${V[2]}" 2>&1 | grep -v "Warn\|warn" | tail -24
echo "== llama3-8b fp8 batch-1 after 512 tokens, PAGODA_L2_PREFETCH=lines"
PAGODA_L2_PREFETCH=lines timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy \
  --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 \
  --timeout 190 --out "$OUT/llama_fp8_b1_prefetch.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
