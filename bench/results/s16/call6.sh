export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
date -u +%H:%M:%S
TRITON_INTERPRET=0 PYTHONPATH=/tmp/site:/tmp/tests-path timeout 200 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_fp8.py -k "quant or gemm or linear" 2>&1 | tail -3
date -u +%H:%M:%S
timeout 300 python3 .gpu/splitk.py 2>&1 | grep -v -i warn | tail -30
date -u +%H:%M:%S
timeout 120 python3 .gpu/prof256.py llama3-8b 256 2>&1 | grep -v -i warn | grep -E "step|silu|norm_quant|nvjet|paged" 
date -u +%H:%M:%S
