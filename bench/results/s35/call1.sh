#!/usr/bin/env bash
# Session 35's first device call (for the next session: no device time was left in this one): the W8A8 experts' GPU
# test, FP8 experts tuned weight-only against W8A8 per bucket and GEMM (moe_tune --weights fp8: the FP8 tables), one
# shape at a time, then FP8 against bf16 with those tables. On a card other than an H200 the H200's tables are
# installed under its name first (dispatch and tiles the H200's; timings and the FP8 tables this card's). Commit
# $OUT/moe_fp8_tables/*.json under kernels/moe_configs/ where FP8 wins. Fits the 600 s a call may run.
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
# gpu_check.sh's row printer, without running it again (it would reinstall the package over the copied tables)
source <(sed -n '/^moe_sweep_rows()/,/^}/p' bench/gpu_check.sh)
timeout 80 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu -k w8a8 2>&1 | tail -2
mkdir -p "$OUT/moe_fp8_tables"
for shape in deepseek-v2-lite qwen3-30b-a3b; do
  echo "== $shape: FP8 experts tuned, weight-only and W8A8 tiles [$(( $(date +%s) - start )) s]"
  timeout $(( $(left) / 2 - 40 )) python3 -m pagoda.bench.moe_tune --weights fp8 --shapes $shape \
    --buckets 128,256,512,1024,2048,4096,8192 --write --out "$OUT/moe_tune_fp8_$shape.json" 2>&1 \
    | grep -v "^{\|skip\|Warn" | tail -12
  python3 - "$OUT/moe_tune_fp8_$shape.json" <<'PY'
import json, sys
for shape in json.load(open(sys.argv[1])):
    print(shape["shape"], " ".join(f"{b}:{'8' if e['gate_up'].get('act_fp8') else '16'}/{'8' if e['down'].get('act_fp8') else '16'}"
                                   for b, e in shape["table"].items()), "(activation bits, gate_up/down)")
PY
done
cp /tmp/site/pagoda/kernels/moe_configs/*dtype=float8_e4m3fn* "$OUT/moe_fp8_tables/" 2>/dev/null
echo "== FP8 experts against bf16 with the FP8 tables [$(( $(date +%s) - start )) s]"
timeout $(( $(left) - 5 )) python3 -m pagoda.bench.moe_fp8_sweep --tokens 128,1024,8192 \
  --out "$OUT/moe_fp8_sweep_tables.json" 2>&1 | moe_sweep_rows
