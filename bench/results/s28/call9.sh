# Twenty-eighth session, call 9 (experiment, not a default): the first run's stall with the caching allocator's
# expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), then the v2-lite reference x3 with it.
set -u
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
echo "## first_steps"; timeout 200 python3 bench/results/s28/first_steps.py --steps 8 2>&1 | grep -v "^\[W\|UserWarn\|_warn_once" | head -12
echo "## v2-lite reference x3"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --repeats 3 --timeout 190 --out "$OUT/v2lite_reference_expandable.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -8
