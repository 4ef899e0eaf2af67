export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
echo "== attention launch shapes after the empty-split change"
timeout 150 python3 .gpu/attn_b1.py 1,4 512,1024,2048 2>&1 | grep -A2 "^B="
date -u +%H:%M:%S
echo "== decode step, graph (base only)"
timeout 120 python3 .gpu/fuse_ab.py llama3-8b fp8 1,2,8 512 base= 2>&1 | tail -4
date -u +%H:%M:%S
echo "== GPU tests: attention, MLA, splits"
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 240 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_attention_splits.py tests/test_kernels.py tests/test_mla.py 2>&1 | tail -3
date -u +%H:%M:%S
echo "== engine batch-1: llama fp8, v2-lite"
timeout 110 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 --out $OUT/b1_llama_fp8.json 2>&1 | grep -E "batch-1|Error|error" | tail -3 | cut -c1-240
timeout 110 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 --out $OUT/b1_v2lite.json 2>&1 | grep -E "batch-1|Error|error" | tail -3 | cut -c1-240
date -u +%H:%M:%S
