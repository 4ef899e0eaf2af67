#!/usr/bin/env bash
# Session 49, call 1. On an H200: session 48's unrun H200 work (bench/results/s48/call1.sh: the o retune at 64 / 128
# rows, llama3-8b FP8 batch-1, deepseek-v2-lite reference + batch-1). On another card: the new logprob_token_ids
# gather on the CUDA sampling path, and the sampler's gpu tests around it, then stop.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card == NVIDIA_H200 ]]; then exec bash bench/results/s48/call1.sh; fi
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
echo "== not an H200 ($card): logprob_token_ids and the sampler's gpu tests [$(( $(date +%s) - start )) s]"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rfE --tb=short --durations=8 \
  tests/test_logprob_token_ids.py tests/test_sampler.py tests/test_sampling_state.py 2>&1 | tee "$OUT/gpu_tests.txt" \
  | grep -E "^(ERROR|FAILED)|passed|failed|error|s call|Error" | tail -30
echo "== done [$(( $(date +%s) - start )) s]"
# Run at 12:08 UTC on an H100 (bbcf98a): 5 passed (h100_call1.txt). A second command on the same warm H100 ran
# `-m gpu tests/test_async_scheduling.py tests/test_batch_state.py tests/test_sampling_state.py`: 4 passed
# (h100_call2.txt: CUDA graphs with async scheduling, the worker's batch and sampling state on CUDA).
