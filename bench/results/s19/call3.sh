# nineteenth session, call 3: issue 20 / 25 figures with the new defaults (qk_fp8x2 decode and 64-key staged chunks
# over an fp8 cache, the MoE sum in the next norm, SiLU in the FP8 down GEMV at one row); committed W8A16 table
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
f() { grep -v "^[a-z-]*: {" | tail -${1:-3} | cut -c1-250; }
date -u +%T; echo "== llama3-8b fp8 batch-1"
timeout 80 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 70 --out $OUT/llama_fp8_b1.json 2>&1 | f 2
W=(--num-prompts 256 --input-len 512 --input-len-jitter 0 --output-len 256 --load-format dummy)
for kv in auto fp8; do
  date -u +%T; echo "== qwen3-0.6b reference kv $kv"
  timeout 75 python3 -m pagoda.bench throughput --model qwen3-0.6b "${W[@]}" --kv-cache-dtype $kv --timeout 65 --out $OUT/qwen3_kv_$kv.json 2>&1 | f 3
done
date -u +%T; echo "== trtllm-1000 fp8 + fp8 kv"
timeout 190 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 175 --out $OUT/trtllm1000.json 2>&1 | f 4
date -u +%T; echo "== deepseek-v2-lite reference + batch-1"
timeout 150 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference --latency-prompt-len 512 --timeout 140 --out $OUT/v2lite_reference.json 2>&1 | f 5
date -u +%T
