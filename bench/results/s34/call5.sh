#!/usr/bin/env bash
# Session 34, one combined call (the device was refused six times; budget for one call): GPU tests of session 33's
# kernel variants, the split-K A/B on llama3-8b FP8 at 1-64 rows, the MoE expert shapes' FP8 against bf16, then (H200
# only) the 16-bit GEMV tuned for deepseek-v2-lite's aq / o at 128 and 256 rows with a step A/B. On another card the
# H200's tuned tables are installed under its name, so dispatch and tiles are the H200's (timings are this card's).
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
echo "== gpu tests: test_fp8.py -m gpu, test_qkv_prep.py (all, on the GPU where they use one) [$(( $(date +%s) - start )) s]"
timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8.py -m gpu -rf --tb=short 2>&1 | tail -4
timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_qkv_prep.py -rf --tb=short 2>&1 | tail -4
echo "== llama3-8b fp8 decode step: split-K sums in kernels of their own / in the norms / also in qkv prep [$(( $(date +%s) - start )) s]"
timeout 170 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,2,8,32,64 \
  --context 512 --rounds 3 sum_kernels=PAGODA_FUSE_SPLIT_K=0 norms=PAGODA_FUSE_SPLIT_K=norms \
  all=PAGODA_FUSE_SPLIT_K=1 2>&1 | tail -8
echo "== moe fp8 sweep [$(( $(date +%s) - start )) s]"
timeout 130 python3 -m pagoda.bench.moe_fp8_sweep --out "$OUT/moe_fp8_sweep.json" 2>&1 | tee "$OUT/moe_fp8_sweep.txt" \
  | python3 -c "import json, sys
for line in sys.stdin:
    if not line.startswith('{'):
        print(line.rstrip()[:300]); continue
    r = json.loads(line)
    print(f\"{r['shape'][:14]:14s} T={r['tokens']:5d} bf16 {r['bf16_us']:8.1f} ({r['bf16_hbm_fraction']:.2f}) fp8 \"
          f\"{r['fp8_us']:8.1f} ({r['fp8_hbm_fraction']:.2f}) {r['speedup_fp8']:.2f}x err {r['fp8_rel_err']:.4f}\")" | grep -v Warn
left=$(( 585 - ($(date +%s) - start) ))
echo "== [$(( $(date +%s) - start )) s, $left s left]"
if [[ $card == NVIDIA_H200 && $left -gt 120 ]]; then
  timeout $(( left - 60 )) python3 -m pagoda.bench.gemv_tune --models deepseek-v2-lite --layers aq,o --buckets 128,256 \
    --out "$OUT/gemv_tune" 2>&1 | grep -E "^tune|tuned|^precompiled" | cut -c1-220
  table=$(python3 -c "import torch; from pagoda.kernels import gemv
print(gemv.config_name(torch.cuda.get_device_name().replace(' ', '_')))")
  cp "$OUT"/gemv_tune/dense_table.json "/tmp/site/pagoda/kernels/gemv_configs/$table" && echo "installed $table"
  left=$(( 590 - ($(date +%s) - start) ))
  timeout $left python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 128,256 --context 640 \
    off=PAGODA_DENSE_GEMV=0 tuned=PAGODA_DENSE_GEMV= 2>&1 | grep "B=" | tail -4
fi
