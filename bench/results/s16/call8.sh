export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
date -u +%H:%M:%S
timeout 60 python3 .gpu/qcheck.py 2>&1 | grep -v -i warn
timeout 150 python3 .gpu/prof_prefill.py llama3-8b 32 512 fp8 2>&1 | grep -v -i warn | tail -26
date -u +%H:%M:%S
