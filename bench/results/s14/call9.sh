export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_sampler.py -k "argmax or greedy" 2>&1 | tail -1
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 200 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_async_scheduling.py -m gpu 2>&1 | tail -1
timeout 60 python3 .gpu/argmax_bench.py 2>&1 | grep argmax
echo "== llama fp8 batch-1 engine"
timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 80 --out $OUT/b1_llama_fp8.json 2>&1 | grep "batch-1" | cut -c1-200
echo "== v2-lite batch-1 engine"
timeout 120 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 100 --out $OUT/b1_v2lite.json 2>&1 | grep "batch-1" | cut -c1-200
echo "== llama fp8 reference"
timeout 170 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --workload reference --latency-prompt-len 512 --timeout 150 --out $OUT/ref_llama_fp8.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
