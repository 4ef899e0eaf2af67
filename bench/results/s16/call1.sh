export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
date -u +%H:%M:%S
echo "== llama3-8b fp8 decode step, graph, L2 prefetch variants"
timeout 200 python3 .gpu/fuse_ab.py llama3-8b fp8 1,2,8 512 off=PAGODA_L2_PREFETCH=0 attn=PAGODA_L2_PREFETCH=attn gu8=PAGODA_L2_PREFETCH=attn,gu:8 gu24=PAGODA_L2_PREFETCH=attn,gu:24 next12=PAGODA_L2_PREFETCH=next:12 all=PAGODA_L2_PREFETCH=attn,gu:8,down:8,next:8 2>&1 | grep -E "B=|Error|error" | tail -6
date -u +%H:%M:%S
echo "== llama3-8b bf16"
timeout 120 python3 .gpu/fuse_ab.py llama3-8b none 1 512 off=PAGODA_L2_PREFETCH=0 attn=PAGODA_L2_PREFETCH=attn gu16=PAGODA_L2_PREFETCH=attn,gu:16 all=PAGODA_L2_PREFETCH=attn,gu:8,down:8,next:8 2>&1 | grep -E "B=|Error|error" | tail -3
date -u +%H:%M:%S
