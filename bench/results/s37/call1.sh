#!/usr/bin/env bash
# Session 37, call 1: the FP8 gmm path (per-row W8A8 experts on torch._scaled_grouped_mm, default from 12 rows an
# expert since the thirty-sixth session) in served traffic, which was never measured: the reference workload on
# qwen3-30b-a3b and deepseek-v2-lite with FP8 weights, default against PAGODA_MOE_FP8_GMM=0 (Triton FP8 experts
# everywhere), each run its own process; then deepseek-v2-lite's FP8 decode step at B = 128 / 256 (15.5 / 31 rows an
# expert) both ways (step_ab, graph-timed). On a card other than an H200 the H200's tables are installed under its
# name first. First deepseek-v2-lite's experts around 1024 tokens kernel by kernel (moe_profile.py).
# ~550 s.
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
echo "== v2-lite experts around 1024 tokens, kernel by kernel [$(( $(date +%s) - start )) s]"
timeout 100 python3 bench/results/s37/moe_profile.py 2>&1 | tail -40
for shape in qwen3-30b-a3b deepseek-v2-lite; do
  for gmm in auto 0; do
    echo "== $shape FP8 reference, PAGODA_MOE_FP8_GMM=$gmm [$(( $(date +%s) - start )) s]"
    PAGODA_MOE_FP8_GMM=$gmm timeout 150 python3 -m pagoda.bench throughput --model $shape --load-format dummy \
      --quantization fp8 --workload reference --timeout 120 --out "$OUT/ref_${shape}_gmm_$gmm.json" 2>&1 \
      | grep -v "^[a-z-]*: {" | tail -4
  done
done
echo "== deepseek-v2-lite FP8 decode step [$(( $(date +%s) - start )) s]"
timeout $(( 590 - ($(date +%s) - start) )) python3 -m pagoda.bench.step_ab --model deepseek-v2-lite \
  --quantization fp8 --batches 128,256 --context 640 triton=PAGODA_MOE_FP8_GMM=0 gmm=PAGODA_MOE_FP8_GMM=1 2>&1 | tail -8
echo "== done [$(( $(date +%s) - start )) s]"
