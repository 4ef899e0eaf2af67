#!/usr/bin/env bash
# Session 38, call 1: (1) the gmm paths' GPU tests, the expert split's with its fixed 64-token set-up (not rerun on a
# GPU after session 37's fix); (2) issue 25 item 3's MoE rows: moe_fp8_sweep over 1-8192 tokens with the committed
# dispatch (the split per shape); (3) issue 25's two dense cells (llama3-8b o at 64 / 128 rows, FP8 0.95x / 0.85x of
# bf16 in the thirty-second session): o retuned at those buckets with the norm after it, then swept with that table.
# Commit $OUT/tune_o/w8a16*.json under kernels/fp8_configs/ if it wins. On a card other than an H200 the H200's
# tables are installed under its name first.
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
timeout 70 python3 -m pytest -q --tb=short -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu \
  -k "w8a8 or gmm or split" -rf 2>&1 | grep -E "Error|assert|passed|failed|FAILED" | tail -8
echo "== FP8 experts against bf16, committed dispatch, 1-8192 tokens [$(( $(date +%s) - start )) s]"
timeout 110 python3 -m pagoda.bench.moe_fp8_sweep --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192 \
  --out "$OUT/moe_fp8_sweep.json" 2>&1 | moe_sweep_rows
echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
timeout 280 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
  2>&1 | grep -E "^(precompiled|tune|sweep|FP8|o )" | cut -c1-240
ls "$OUT/tune_o" 2>/dev/null
echo "== done [$(( $(date +%s) - start )) s]"
