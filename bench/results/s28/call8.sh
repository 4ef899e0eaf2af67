# Twenty-eighth session, call 8 (final tree): the first run's last prefill-carrying step with the prefill-size
# warm-up, then the v2-lite reference x3 + batch-1.
set -u
echo "## first_steps"; timeout 200 python3 bench/results/s28/first_steps.py --steps 8 2>&1 | grep -v "^\[W\|UserWarn\|_warn_once" | grep -v "cpu_op:aten::\(to\|_to_copy\|t\|fill_\|full\)$" | head -40
echo "## v2-lite reference x3 + batch-1"
timeout 250 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --repeats 3 --timeout 240 --out "$OUT/v2lite_reference_final.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -12
