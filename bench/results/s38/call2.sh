#!/usr/bin/env bash
# Session 38, call 2: (H200 only) llama3-8b o retuned at 64 / 128 rows, the H200's table (call 1 did it on an H100);
# then the 16-bit GEMV tuned for deepseek-v2-lite's [kv_a || q] and o at decode batches 128 / 256 (the twenty-ninth
# session's preparation, never timed: at 256 rows a sparse layer's cuBLAS GEMMs took ~25-30 us against ~8 by bytes),
# installed, the decode step A/B at B = 128 / 256 against cuBLAS (PAGODA_DENSE_GEMV=0), then the reference workload
# with the tuned table. Commit $OUT/gemv_tune/dense_table.json (and $OUT/tune_o/w8a16_table.json) under
# kernels/*_configs/ if they win. On another card the H200's tables are installed under its name first.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
else
  echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
  timeout 120 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
    2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
fi
echo "== deepseek-v2-lite 16-bit GEMV tuned at 128 / 256 rows [$(( $(date +%s) - start )) s]"
timeout 200 python3 -m pagoda.bench.gemv_tune --models deepseek-v2-lite --layers aq,o --buckets 128,256 \
  --out "$OUT/gemv_tune" 2>&1 | grep -E "^tune|tuned|^precompiled" | cut -c1-240
table=$(python3 -c "import torch; from pagoda.kernels import gemv
print(gemv.config_name(torch.cuda.get_device_name().replace(' ', '_')))")
cp "$OUT"/gemv_tune/dense_table.json "/tmp/site/pagoda/kernels/gemv_configs/$table" && echo "installed $table"
echo "== decode step A/B [$(( $(date +%s) - start )) s]"
timeout 120 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 128,256 --context 640 \
  off=PAGODA_DENSE_GEMV=0 tuned=PAGODA_DENSE_GEMV= 2>&1 | grep "B=" | tail -4
left=$(( 560 - ($(date +%s) - start) ))
echo "== deepseek-v2-lite reference, tuned table [$(( $(date +%s) - start )) s, $left s left]"
if (( left > 90 )); then
  timeout $(( left - 5 )) python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy \
    --workload reference --timeout $(( left - 15 )) --out "$OUT/v2lite_reference_tuned.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -3
fi
echo "== done [$(( $(date +%s) - start )) s]"
