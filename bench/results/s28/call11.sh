# Twenty-eighth session, call 11 (final tree, the MLA kernel without its expand skip): GPU tests of the MLA and
# DeepSeek files, then one v2-lite reference run with batch-1.
set -u
echo "## gpu tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu tests/test_mla.py tests/test_deepseek.py tests/test_moe.py 2>&1 | tail -3
echo "## v2-lite reference x1 + batch-1"
timeout 130 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
  --latency-prompt-len 512 --timeout 120 --out "$OUT/v2lite_reference_final.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -6
