export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
echo "== llama3-8b fp8 decode step, graph, L2 prefetch on a side stream"
timeout 200 python3 .gpu/fuse_ab.py llama3-8b fp8 1,8 512 off=PAGODA_L2_PREFETCH=0 attn=PAGODA_L2_PREFETCH=attn\;PAGODA_L2_PREFETCH_STREAM=1 gu16=PAGODA_L2_PREFETCH=attn,gu:16\;PAGODA_L2_PREFETCH_STREAM=1 next8=PAGODA_L2_PREFETCH=next:8\;PAGODA_L2_PREFETCH_STREAM=1 all=PAGODA_L2_PREFETCH=attn,gu:8,down:8,next:8\;PAGODA_L2_PREFETCH_STREAM=1 inline=PAGODA_L2_PREFETCH=attn\;PAGODA_L2_PREFETCH_STREAM=0 2>&1 | grep -E "B=|Error|error" | tail -6
date -u +%H:%M:%S
