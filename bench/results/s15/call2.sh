export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
for w in openai reference; do
echo "== llama fp8 $w"
timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --workload $w --timeout 130 --out $OUT/${w}_llama_fp8.json 2>&1 | grep -v "^[a-z-]*: {" | tail -4 | cut -c1-240
date -u +%H:%M:%S
done
echo "== attention B=1 ctx 512 (head of the sweep)"
timeout 100 python3 .gpu/attn_b1.py 1 512 2>&1 | head -8
