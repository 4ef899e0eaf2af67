export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
echo "== preload A/B, llama3-8b fp8 decode step (graph), B=1,2, 512 cached"
timeout 200 python3 .gpu/fuse_ab.py llama3-8b fp8 1,2 512 base=PAGODA_GEMV_PRELOAD=0 gemv=PAGODA_GEMV_PRELOAD=1 attn=PAGODA_ATTN_PRELOAD=1 both=PAGODA_GEMV_PRELOAD=1,PAGODA_ATTN_PRELOAD=1 base2=PAGODA_GEMV_PRELOAD=0 both2=PAGODA_GEMV_PRELOAD=1,PAGODA_ATTN_PRELOAD=1 2>&1 | tail -24
date -u +%H:%M:%S
echo "== GPU tests of the preload paths + async scheduling"
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 200 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_attention_preload.py tests/test_fp8_weight_only.py tests/test_qkv_prep.py 2>&1 | tail -3
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 200 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_async_scheduling.py -m gpu 2>&1 | tail -4
date -u +%H:%M:%S
for pre in 0 1; do
echo "== engine llama fp8 batch-1, preloads=$pre"
PAGODA_GEMV_PRELOAD=$pre PAGODA_ATTN_PRELOAD=$pre timeout 110 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 --out $OUT/b1_llama_fp8_pre$pre.json 2>&1 | grep -E "batch-1|Error|error" | tail -3 | cut -c1-240
done
date -u +%H:%M:%S
echo "== attention B=1/4 launch shapes"
timeout 120 python3 .gpu/attn_b1.py 2>&1 | tail -40
date -u +%H:%M:%S
