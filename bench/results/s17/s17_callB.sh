export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S; echo "== trtllm-1000 fp8 + fp8 kv"
timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 180 --out $OUT/trtllm1000.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-250
date -u +%H:%M:%S; echo "== llama3-8b fp8 batch-1"
timeout 80 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 70 --out $OUT/llama_fp8_b1.json 2>&1 | grep -v "^[a-z-]*: {" | tail -3 | cut -c1-250
date -u +%H:%M:%S; echo "== deepseek-v2-lite reference + batch-1"
timeout 200 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference --latency-prompt-len 512 --timeout 180 --out $OUT/v2lite_reference.json 2>&1 | grep -v "^[a-z-]*: {" | tail -5 | cut -c1-250
date -u +%H:%M:%S
