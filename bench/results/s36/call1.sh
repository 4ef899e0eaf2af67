#!/usr/bin/env bash
# Session 36's first device call: FP8 experts at prefill sizes, where FP8 lost to bf16 (0.66-0.98x at 1024-8192
# tokens, H100, session 34). (1) GPU tests of the W8A8 grouped GEMM and of the new gmm FP8 path (per-row W8A8 on
# torch._scaled_grouped_mm); (2) FP8 vs bf16 at 256-8192 tokens with both FP8 paths (committed tables); (3) with
# the time left, FP8 tables tuned (weight-only against W8A8 tiles, moe_tune --weights fp8) for deepseek-v2-lite,
# then the sweep with them. On a card other than an H200 the H200's tables are installed under its name first.
# Commit $OUT/moe_fp8_tables/*.json under kernels/moe_configs/ where FP8 wins; make the gmm path the default from
# the token count where it wins. Fits the 600 s a call may run.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
left() { echo $(( 585 - ($(date +%s) - start) )); }
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
source <(sed -n '/^moe_sweep_rows()/,/^}/p' bench/gpu_check.sh)
echo "== GPU tests [$(( $(date +%s) - start )) s]"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu \
  -k "w8a8 or fp8_gmm or gmm_path" 2>&1 | tail -3
echo "== FP8 (triton, gmm) against bf16, committed tables [$(( $(date +%s) - start )) s]"
timeout 150 python3 -m pagoda.bench.moe_fp8_sweep --tokens 256,1024,2048,8192 \
  --out "$OUT/moe_fp8_sweep_gmm.json" 2>&1 | moe_sweep_rows
mkdir -p "$OUT/moe_fp8_tables"
shape=deepseek-v2-lite
echo "== $shape: FP8 experts tuned, weight-only and W8A8 tiles [$(( $(date +%s) - start )) s]"
timeout $(( $(left) - 90 )) python3 -m pagoda.bench.moe_tune --weights fp8 --shapes $shape \
  --buckets 128,256,512,1024 --write --out "$OUT/moe_tune_fp8_$shape.json" 2>&1 \
  | grep -v "^{\|skip\|Warn" | tail -8
cp /tmp/site/pagoda/kernels/moe_configs/*dtype=float8_e4m3fn* "$OUT/moe_fp8_tables/" 2>/dev/null
ls "$OUT/moe_fp8_tables"
echo "== FP8 against bf16 with the FP8 table [$(( $(date +%s) - start )) s]"
timeout $(( $(left) - 5 )) python3 -m pagoda.bench.moe_fp8_sweep --shapes $shape --tokens 128,256,512,1024 \
  --out "$OUT/moe_fp8_sweep_tables.json" 2>&1 | moe_sweep_rows
