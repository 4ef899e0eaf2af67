# Twenty-eighth session, call 1: the reference's prefill-carrying steps as the engine runs them, then the sampled
# workload on deepseek-v2-lite (not measured since session 27's changes).
set -u
echo "## engine_steps 4 vs 5"; timeout 240 python3 bench/results/s27/engine_steps.py --steps 14 2>&1 | grep -v "^\[W" | tail -40
echo "## v2-lite sampled"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload sampled \
  --timeout 190 --out "$OUT/v2lite_sampled.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -8
