export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
echo "== llama fp8 + fp8 KV reference"
timeout 140 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --workload reference --latency-prompt-len 512 --timeout 120 --out $OUT/ref_llama_fp8_kvfp8.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
echo "== deepseek-v2-lite reference"
timeout 150 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference --latency-prompt-len 512 --timeout 130 --out $OUT/ref_v2lite.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
