# Twenty-eighth session, call 5 (final alignment dispatch: a program per expert from 32 experts, 4 warps x 512 up
# to 512 pairs, else 8 x 1024): GPU tests of the MoE and DeepSeek files, then v2-lite reference x3 (+ batch-1) and
# sampled, and qwen3-30b-a3b's reference.
set -u
echo "## gpu tests"; timeout 300 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu tests/test_moe.py tests/test_deepseek.py tests/test_mla.py 2>&1 | tail -3
echo "## v2-lite reference x3 + batch-1"
timeout 250 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --repeats 3 --timeout 240 --out "$OUT/v2lite_reference.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -8
echo "## v2-lite sampled"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload sampled \
  --timeout 190 --out "$OUT/v2lite_sampled.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -5
echo "## qwen3-30b-a3b reference"
timeout 200 python3 -m pagoda.bench throughput --model qwen3-30b-a3b --load-format dummy --workload reference \
  --latency-prompt-len 512 --timeout 190 --out "$OUT/qwen3_30b_reference.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -6
