#!/usr/bin/env bash
# Session 37, call 3: the expert split with its measured bounds (kernels/moe.expert_split: only where rows / experts
# is above 128 and at most 272; at most 1023 groups, torch's limit, which call 2's unbounded split hit at 8192
# tokens). (1) the gmm paths' GPU tests; (2) moe_fp8_sweep at 1024-4096 tokens with the split and without
# (PAGODA_MOE_FP8_GMM_SPLIT=0). ~200 s (the budget left: 500 s). On a card other than an H200 the H200's tables are
# installed under its name first.
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
timeout 90 python3 -m pytest -q --tb=line -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu \
  -k "w8a8 or gmm or split" 2>&1 | tail -4
for split in 1 0; do
  echo "== FP8 against bf16, PAGODA_MOE_FP8_GMM_SPLIT=$split [$(( $(date +%s) - start )) s]"
  PAGODA_MOE_FP8_GMM_SPLIT=$split timeout 80 python3 -m pagoda.bench.moe_fp8_sweep \
    --tokens 1024,2048,3072,4096 --out "$OUT/moe_fp8_sweep_split_$split.json" 2>&1 | moe_sweep_rows
done
echo "== done [$(( $(date +%s) - start )) s]"
