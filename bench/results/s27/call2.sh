# call 2: v2-lite batch-1 pieces: the MoE GEMVs at one token over a wide tile set; the 16-bit GEMV tuned for
# v2-lite's projections (first run of PHASES=dense-gemv) and the step with it; the B=256 decode step by kernel.
set -u
echo "## moe_b1"; timeout 200 python3 bench/results/s27/moe_b1.py 2>&1 | grep -v "^skip" | tail -40
echo "## dense-gemv"
DENSE_MODELS=deepseek-v2-lite DENSE_MODELS_AB=deepseek-v2-lite PHASES=dense-gemv timeout 240 bash bench/gpu_check.sh 2>&1 | tail -20
cp -r "$OUT"/gemv_tune "$OUT"/gemv_tune_keep 2>/dev/null
echo "## v2-lite B=256 profile"
timeout 120 python3 -m pagoda.bench.deepseek_bench --model deepseek-v2-lite --quantization none --batches 256 --profile \
  --out "$OUT/v2lite_profile_b256.json" 2>&1 | grep -v "^{" | grep -v Warn | tail -45
