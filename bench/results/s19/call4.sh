# nineteenth session, call 4: llama3-8b FP8 batch-1 on the committed W8A16 table with SiLU in the down GEMV at one
# row (call 3's run timed out while compiling), then deepseek-v2-lite's batch-1 step by kernel
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%T; echo "== llama3-8b fp8 batch-1"
timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 140 --out $OUT/llama_fp8_b1.json 2>&1 | grep -v "^[a-z-]*: {" | tail -2 | cut -c1-250
date -u +%T; echo "== deepseek-v2-lite batch-1 by kernel"
timeout 160 python3 -m pagoda.bench.deepseek_bench --model deepseek-v2-lite --quantization none --batches 1 --profile --out $OUT/deepseek_v2_lite_profile.json 2>&1 | grep -v "^{" | tail -45 | cut -c1-200
date -u +%T
