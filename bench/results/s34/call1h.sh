#!/usr/bin/env bash
# Session 34, call 1 on whichever Hopper card comes (H200s were refused four times): GPU tests of session 33's
# kernel variants, the split-K A/B on llama3-8b FP8 at 1-64 rows, then the MoE expert shapes' FP8 against bf16.
# On a card other than the H200 the H200's tuned tables are installed under this card's name, so dispatch and
# tiles are the H200's (timings are this card's).
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
echo "== gpu tests: test_fp8.py -m gpu, test_qkv_prep.py (all, on the GPU where they use one)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8.py -m gpu -rf --tb=short 2>&1 | tail -6
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_qkv_prep.py -rf --tb=short 2>&1 | tail -6
# (gpu_check.sh's split-k-ab phase, inline: running gpu_check.sh again would reinstall the package without the
# copied tables)
echo "== llama3-8b fp8 decode step: split-K sums in kernels of their own / in the norms / also in qkv prep"
timeout 300 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,2,8,32,64 \
  --context 512 --rounds 3 sum_kernels=PAGODA_FUSE_SPLIT_K=0 norms=PAGODA_FUSE_SPLIT_K=norms \
  all=PAGODA_FUSE_SPLIT_K=1 2>&1 | tail -8
echo "== moe fp8 sweep"
timeout 200 python3 -m pagoda.bench.moe_fp8_sweep --out "$OUT/moe_fp8_sweep.json" 2>&1 | tail -30
