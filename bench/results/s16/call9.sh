export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
timeout 60 python3 .gpu/fa_err.py 2>&1 | grep -v -i warn
for fa in 1 0; do
echo "== quality, PAGODA_FP8_FAST_ACCUM=$fa"
PAGODA_FP8_FAST_ACCUM=$fa timeout 150 python3 -m pagoda.bench.fp8_bench --parts quality --num-prompts 32 --out $OUT/quality_fa$fa.json 2>&1 | grep '^{' | cut -c1-400
date -u +%H:%M:%S
done
for kv in auto fp8; do
echo "== llama fp8 reference, kv $kv, fast accumulation"
timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype $kv --workload reference --timeout 130 --out $OUT/reference_llama_fp8_kv${kv}_fa.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
done
