#!/usr/bin/env bash
# Session 31, call 2 (after the switches' removal, b1681e1): the default paths' GPU tests that call 1's filter matched, then trtllm-1000 (llama3-8b FP8 + FP8 KV)
# with the swap space (the default, 16 GiB) and with --swap-space 0 (recompute, as before).
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8_decode_gluon.py \
  tests/test_attention_splits.py tests/test_fp8.py -m gpu -k "quant or empty_splits" -rf --tb=line 2>&1 \
  | grep -E "^(FAILED|E )|passed|failed" | cut -c1-230 | head -30
for swap in 16 0; do
  echo "== llama3-8b fp8 + fp8 kv, trtllm-1000, --swap-space $swap"
  timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --kv-cache-dtype fp8 --workload trtllm-1000 --swap-space $swap --timeout 190 --out "$OUT/trtllm_swap$swap.json" \
    2>&1 | grep -v "^[a-z-]*: {" | tail -4
  python3 -c "import json; r = json.load(open('$OUT/trtllm_swap$swap.json'))['results'][0]; print({k: r.get(k) for k in ('output_tok_per_s', 'elapsed_s', 'num_preemptions', 'num_swapped', 'num_swap_blocks', 'num_kv_blocks', 'decode_steps', 'mixed_steps_gpu_s', 'decode_steps_gpu_s', 'load_s')})"
done
