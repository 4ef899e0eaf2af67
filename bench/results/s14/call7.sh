export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
echo "== GPU tests"
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8_weight_only.py tests/test_pdl.py 2>&1 | tail -2
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 90 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_mla.py -m gpu 2>&1 | tail -1
echo "== fuse A/B (graph step)"
PROFILE=1 timeout 150 python3 .gpu/fuse_ab.py llama3-8b fp8 1,2,4,8 512 sep=PAGODA_FUSE_SPLIT_K=0 fused=PAGODA_FUSE_SPLIT_K=1 2>&1 | grep -v "Warn\|warn" | cut -c1-200
for f in 1 0; do
echo "== llama fp8 batch-1 engine PAGODA_FUSE_SPLIT_K=$f"
PAGODA_FUSE_SPLIT_K=$f timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 80 --out $OUT/b1_llama_fp8_fuse$f.json 2>&1 | grep "batch-1" | cut -c1-200
done
date -u +%H:%M:%S
