#!/usr/bin/env bash
# Session 53, call 1, H200 only (on another card: name it and stop). With little device budget left, session 48's
# unrun H200 work in order of what its issue lacks most: llama3-8b FP8 batch-1 (#25's 2.6 ms target), then
# deepseek-v2-lite reference + batch-1 (#20), then llama3-8b's o retuned at 64 / 128 rows if time is left.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then echo "== not an H200 ($card): nothing run"; exit 0; fi
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
BUDGET=${BUDGET:-300}  # seconds this call may run (the device budget left, less the start)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
timeout $(( $(left) < 100 ? $(left) - 5 : 100 )) python3 -m pagoda.bench throughput --model llama3-8b \
  --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 \
  --latency-prompt-len 512 --timeout 90 --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
if (( $(left) > 120 )); then
  timeout $(( $(left) - 5 )) python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy \
    --workload reference --latency-prompt-len 512 --timeout 100 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -5
fi
echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
if (( $(left) > 100 )); then
  timeout $(( $(left) - 5 )) python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 \
    --out "$OUT/tune_o" 2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
  ls "$OUT/tune_o" 2>/dev/null
fi
echo "== done [$(( $(date +%s) - start )) s]"
