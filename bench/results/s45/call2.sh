#!/usr/bin/env bash
# Session 45, call 2. On an H200: llama3-8b's o retuned at 64 / 128 rows (the H200's cells were 0.95x / 0.85x
# bf16), then llama3-8b FP8 batch-1 and deepseek-v2-lite reference + batch-1. On another card: every test marked
# gpu in tests/ at this tree (the kernels' and the served paths'), then stop.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
left() { echo $(( 560 - ($(date +%s) - start) )); }
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "== not an H200 ($card): H200 tables installed under its name; every gpu test [$(( $(date +%s) - start )) s]"
  timeout $(left) python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rfE --tb=line \
    --continue-on-collection-errors --durations=12 tests 2>&1 | tee "$OUT/gpu_tests.txt" \
    | grep -E "^(ERROR|FAILED)|passed|failed|error|s call" | tail -40
  echo "== done [$(( $(date +%s) - start )) s]"; exit 0
fi
echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
timeout 170 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
  2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
if (( $(left) > 100 )); then
  timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 \
    --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
fi
echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
if (( $(left) > 110 )); then
  timeout 110 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
    --latency-prompt-len 512 --timeout 100 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -5
fi
echo "== done [$(( $(date +%s) - start )) s]"
