#!/usr/bin/env bash
# Session 34, call 6: FP8 experts' W8A8 grouped GEMM (act_fp8) against the weight-only one and bf16 at the token
# counts where call 5 found weight-only FP8 experts slower than bf16 (1024, 8192) and at 256, same machine (not run:
# the device budget was spent; for the next session).
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
for v in 0 auto 1; do
  echo "== PAGODA_MOE_ACT_FP8=$v"
  PAGODA_MOE_ACT_FP8=$v timeout 120 python3 -m pagoda.bench.moe_fp8_sweep --tokens 256,1024,8192 \
    --out "$OUT/moe_fp8_act$v.json" 2>&1 | python3 -c "import json, sys
for line in sys.stdin:
    if not line.startswith('{'):
        print(line.rstrip()[:300]); continue
    r = json.loads(line)
    print(f\"{r['shape'][:14]:14s} T={r['tokens']:5d} bf16 {r['bf16_us']:8.1f} ({r['bf16_hbm_fraction']:.2f}) fp8 \"
          f\"{r['fp8_us']:8.1f} ({r['fp8_hbm_fraction']:.2f}) {r['speedup_fp8']:.2f}x err {r['fp8_rel_err']:.4f}\")" \
    | grep -v Warn
done
