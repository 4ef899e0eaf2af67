#!/usr/bin/env bash
# Session 36, the short form of call1.sh for the budget left (~800 s): the FP8 experts' GPU tests, then FP8 (Triton
# tables as committed, and the gmm path: per-row W8A8 on torch._scaled_grouped_mm) against bf16 at 256-8192 tokens.
# No tuning. On a card other than an H200 the H200's tables are installed under its name first. ~300 s.
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
source <(sed -n '/^moe_sweep_rows()/,/^}/p' bench/gpu_check.sh)
echo "== GPU tests [$(( $(date +%s) - start )) s]"
timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu \
  -k "w8a8 or fp8_gmm or gmm_path" 2>&1 | tail -3
echo "== FP8 (triton, gmm) against bf16, committed tables [$(( $(date +%s) - start )) s]"
timeout 200 python3 -m pagoda.bench.moe_fp8_sweep --tokens 256,1024,2048,4096,8192 \
  --out "$OUT/moe_fp8_sweep_gmm.json" 2>&1 | moe_sweep_rows
echo "== done [$(( $(date +%s) - start )) s]"
