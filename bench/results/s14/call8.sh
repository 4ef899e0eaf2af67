export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8_weight_only.py tests/test_pdl.py 2>&1 | tail -1
echo "== fuse A/B, committed table"
PROFILE=1 timeout 150 python3 .gpu/fuse_ab.py llama3-8b fp8 1,2,8 512 sep=PAGODA_FUSE_SPLIT_K=0 fused=PAGODA_FUSE_SPLIT_K=1 2>&1 | grep -v "Warn\|warn" | cut -c1-160
echo "== tune M=1"
timeout 200 python3 -m pagoda.bench.fp8_tune --buckets 1 --skip-sweep --out $OUT/tune1 2>&1 | grep -v "Warn\|warn" | grep "tune \|tuned\|Error" | cut -c1-260
cp $OUT/tune1/w8a16,device=*.json /tmp/site/pagoda/kernels/fp8_configs/ && echo "installed the M=1 table"
timeout 100 python3 .gpu/fuse_ab.py llama3-8b fp8 1 512 sep=PAGODA_FUSE_SPLIT_K=0 fused=PAGODA_FUSE_SPLIT_K=1 2>&1 | grep "B=" | cut -c1-160
echo "== v2-lite prefill 32x512 (expanded MLA by slice copies)"
timeout 80 python3 .gpu/prof_prefill.py deepseek-v2-lite 32 512 2>&1 | grep -v Warn | head -12 | cut -c1-140
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 100 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_deepseek.py -m gpu 2>&1 | tail -1
timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 80 --out $OUT/b1_llama_fp8.json 2>&1 | grep "batch-1" | cut -c1-200
date -u +%H:%M:%S
