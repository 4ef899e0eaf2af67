#!/usr/bin/env bash
# Session 47, short H200 call (little budget left): llama3-8b's o retuned at 64 / 128 rows only, where FP8 was
# 0.95x / 0.85x bf16 in the thirty-second session's sweep; fp8_tune writes the table and sweeps after tuning. On
# another card: stop at once.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then echo "== not an H200 ($card): done"; exit 0; fi
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
timeout 200 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
  2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
ls "$OUT/tune_o" 2>/dev/null
echo "== done [$(( $(date +%s) - start )) s]"
