# Twenty-seventh session, call 1: the spread alignment fix (9ca8900/d44b1ef) timed, then what it moves.
set -u
echo "## align_spread"; timeout 120 python3 bench/results/s26/align_spread.py 2>&1 | tail -16
echo "## prefill profile"; timeout 150 python3 bench/results/s13/prof_prefill.py deepseek-v2-lite 32 512 2>&1 | head -30
echo "## v2-lite reference x3 + batch-1"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --repeats 3 --timeout 190 --out "$OUT/v2lite_reference.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -8
echo "## v2-lite batch-1 profile"
timeout 150 python3 -m pagoda.bench.deepseek_bench --model deepseek-v2-lite --quantization none --batches 1 --profile \
  --out "$OUT/v2lite_profile_b1.json" 2>&1 | grep -v "^{" | tail -60
