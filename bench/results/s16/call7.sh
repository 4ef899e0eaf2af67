export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8.py -k "quant or gemm or linear" -rf 2>&1 | grep -E "^FAILED|assert|Error|passed|failed" | cut -c1-300 | head -12
date -u +%H:%M:%S
for kv in auto fp8; do
echo "== llama fp8 reference, kv $kv"
timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype $kv --workload reference --timeout 130 --out $OUT/reference_llama_fp8_kv$kv.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
done
echo "== llama fp8 openai"
timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --workload openai --timeout 130 --out $OUT/openai_llama_fp8.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
