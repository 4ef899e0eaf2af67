export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
timeout 400 python3 -m pagoda.bench.fp8_tune --swap-only --buckets 8,16,32,64,128,256 --out $OUT/tune > $OUT/fp8_tune.log 2>&1
grep -E "^tune|tuned|slower|sweep llama3-8b [a-z_]+ +M= *(1|16|64|128|256):" $OUT/fp8_tune.log | cut -c1-250
date -u +%H:%M:%S
W=(--num-prompts 256 --input-len 512 --input-len-jitter 0 --output-len 256 --load-format dummy)
for kv in auto fp8; do
  echo "== qwen3-0.6b reference kv $kv"
  timeout 80 python3 -m pagoda.bench throughput --model qwen3-0.6b "${W[@]}" --kv-cache-dtype $kv --timeout 70 --out $OUT/qwen3_kv_$kv.json 2>&1 | grep -v "^[a-z-]*: {" | tail -3 | cut -c1-250
done
date -u +%H:%M:%S
