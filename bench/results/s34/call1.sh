#!/usr/bin/env bash
# Session 34, call 1: GPU tests of session 33's kernel variants (norm-quant with split-K partials, qkv prep with
# partials), the split-K A/B on llama3-8b FP8 (sum kernels / norms / also qkv prep) at 1-64 rows, then the FP8
# batch-1 figure end to end on the default.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== gpu tests: test_fp8.py -m gpu, test_qkv_prep.py (all, on the GPU where they use one)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8.py -m gpu -rf --tb=short 2>&1 | tail -6
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_qkv_prep.py -rf --tb=short 2>&1 | tail -6
PHASES=split-k-ab OUT=$OUT bash bench/gpu_check.sh 2>&1 | grep -v "^NVIDIA\|^torch"
echo "== llama3-8b fp8 batch-1 after 512 tokens (default)"
timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 190 \
  --out "$OUT/llama_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
