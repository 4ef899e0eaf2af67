#!/usr/bin/env bash
# Session 37, call 2: FP8 experts on torch._scaled_grouped_mm with each expert split into groups where that keeps
# torch's small CUTLASS tiles (M = rows / groups <= 128; kernels/moe.expert_split). Call 1 (H100) found the cliff:
# v2-lite's two expert GEMMs 268 us at 768 tokens (M = 108), 485 at 1024 (M = 139). (1) GPU tests of the gmm paths;
# (2) moe_fp8_sweep at 768-8192 tokens with the split (default) and without (PAGODA_MOE_FP8_GMM_SPLIT=0);
# (3) the FP8 reference workload on deepseek-v2-lite and qwen3-30b-a3b both ways (prefill chunks of up to 8192
# tokens take the split). On a card other than an H200 the H200's tables are installed under its name first.
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
timeout 90 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu \
  -k "w8a8 or gmm or split" 2>&1 | tail -3
for split in 1 0; do
  echo "== FP8 against bf16, PAGODA_MOE_FP8_GMM_SPLIT=$split [$(( $(date +%s) - start )) s]"
  PAGODA_MOE_FP8_GMM_SPLIT=$split timeout 120 python3 -m pagoda.bench.moe_fp8_sweep \
    --tokens 768,1024,2048,4096,8192 --out "$OUT/moe_fp8_sweep_split_$split.json" 2>&1 | moe_sweep_rows
done
for shape in deepseek-v2-lite qwen3-30b-a3b; do
  for split in 1 0; do
    echo "== $shape FP8 reference, PAGODA_MOE_FP8_GMM_SPLIT=$split [$(( $(date +%s) - start )) s]"
    PAGODA_MOE_FP8_GMM_SPLIT=$split timeout $(( 590 - ($(date +%s) - start) )) python3 -m pagoda.bench throughput \
      --model $shape --load-format dummy --quantization fp8 --workload reference --timeout 100 \
      --out "$OUT/ref_${shape}_split_$split.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -4
  done
done
echo "== done [$(( $(date +%s) - start )) s]"
