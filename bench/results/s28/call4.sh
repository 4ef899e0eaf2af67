# Twenty-eighth session, call 4: decode-size alignment, one program vs a program per expert; then the v2-lite
# reference x3 (+ batch-1) with the program-per-expert alignment as the default.
set -u
echo "## align_decode"; timeout 150 python3 bench/results/s28/align_decode.py 2>&1 | tail -20
echo "## test_moe on GPU"; timeout 200 python3 -m pytest -q -x -p no:cacheprovider -o pythonpath= tests/test_moe.py -k "align" 2>&1 | tail -2
echo "## v2-lite reference x3 + batch-1"
timeout 250 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --repeats 3 --timeout 240 --out "$OUT/v2lite_reference.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -8
