#!/usr/bin/env bash
# Session 37, prepared, not run (s34/call4.sh with shorter limits to fit 600 s; H200): the 16-bit GEMV tuned for
# deepseek-v2-lite's projections at decode batches (buckets 128 and 256: the twenty-ninth session's untimed preparation; at B=256 a sparse layer's cuBLAS GEMMs took ~25-30 us
# against ~8 by bytes), step A/B at B=128 / 256, then the reference workload with the tuned table and without it
# (PAGODA_DENSE_GEMV=0) on the same machine. Commit $OUT/gemv_tune/dense_table.json under kernels/gemv_configs/ if
# it wins.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
timeout 240 python3 -m pagoda.bench.gemv_tune --models deepseek-v2-lite --layers aq,o --buckets 128,256 \
  --out "$OUT/gemv_tune" 2>&1 \
  | grep -E "^tune|tuned|^precompiled" | cut -c1-220
table=$(python3 -c "import torch; from pagoda.kernels import gemv
print(gemv.config_name(torch.cuda.get_device_name().replace(' ', '_')))")
cp "$OUT"/gemv_tune/dense_table.json "/tmp/site/pagoda/kernels/gemv_configs/$table" && echo "installed $table"
timeout 130 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 128,256 --context 640 \
  off=PAGODA_DENSE_GEMV=0 tuned=PAGODA_DENSE_GEMV= 2>&1 | grep "B=" | tail -4
for variant in tuned off; do
  echo "== deepseek-v2-lite reference, $variant [$(( $(date +%s) - start )) s]"
  env $([[ $variant == off ]] && echo PAGODA_DENSE_GEMV=0) timeout 110 python3 -m pagoda.bench throughput \
    --model deepseek-v2-lite --load-format dummy --workload reference --timeout 100 \
    --out "$OUT/v2lite_reference_$variant.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -3
done
