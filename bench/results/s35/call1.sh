#!/usr/bin/env bash
# Session 35's first device call (for the next session: no device time was left in this one): FP8 experts tuned
# weight-only against W8A8 per bucket and GEMM (moe_tune --weights fp8, the FP8 tables), then the sweep against
# bf16 with those tables and with weight-only forced, then the W8A8 GPU test (PHASES=moe-act-fp8). On a card other
# than an H200 the H200's tables are installed under its name first (dispatch and tiles the H200's; timings and the
# FP8 tables this card's). Commit $OUT/moe_fp8_tables/*.json under kernels/moe_configs/ where FP8 wins.
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
# the phase's body without a second gpu_check.sh (it would reinstall the package over the copied tables)
source <(sed -n '/^moe_sweep_rows()/,/^}/p' bench/gpu_check.sh)
timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu -k w8a8 2>&1 | tail -2
echo "== FP8 experts tuned, weight-only and W8A8 tiles"
timeout 400 python3 -m pagoda.bench.moe_tune --weights fp8 --shapes deepseek-v2-lite,qwen3-30b-a3b \
  --buckets 128,256,512,1024,2048,4096,8192 --write --out "$OUT/moe_tune_fp8.json" 2>&1 \
  | grep -v "^{\|skip\|Warn" | tail -24
mkdir -p "$OUT/moe_fp8_tables"
cp /tmp/site/pagoda/kernels/moe_configs/*dtype=float8_e4m3fn* "$OUT/moe_fp8_tables/" 2>/dev/null
python3 - "$OUT/moe_tune_fp8.json" <<'PY'
import json, sys
for shape in json.load(open(sys.argv[1])):
    for bucket, entry in shape["table"].items():
        print(shape["shape"][:16], bucket, "gate_up", "w8a8" if entry["gate_up"].get("act_fp8") else "w8a16",
              "down", "w8a8" if entry["down"].get("act_fp8") else "w8a16")
PY
for v in table 0; do
  echo "== FP8 experts against bf16, PAGODA_MOE_ACT_FP8=$v"
  PAGODA_MOE_ACT_FP8=$v timeout 100 python3 -m pagoda.bench.moe_fp8_sweep --tokens 128,256,1024,8192 \
    --out "$OUT/moe_act_fp8_$v.json" 2>&1 | moe_sweep_rows
done
