#!/usr/bin/env bash
# Session 39, call 1, on the session's tree: (1) the GPU tests of the served paths this session changed (the
# scheduler's drop-only plans when it goes idle, c022a60; prompt tokens counted at admission, 4e8e2a3): the sampler,
# beam search on the device, async scheduling, the grammar bitmask, PDL and the kernel tests; (2) constrained rows
# served on the GPU after the grammar changes (bench/structured.py, grammar process on, every row and a quarter
# constrained); (3) as the time left allows, issue 25 / 20's figures on this card: llama3-8b FP8 batch-1,
# deepseek-v2-lite reference + batch-1.
# On a card other than an H200 the H200's tables are installed under its name first.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
fi
left() { echo $(( 570 - ($(date +%s) - start) )); }
echo "== GPU tests [$(( $(date +%s) - start )) s]"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rf --tb=short \
  tests/test_sampler.py tests/test_sampler_kernel_path.py tests/test_sampler_warmup.py tests/test_beam_device.py \
  tests/test_async_scheduling.py tests/test_grammar_bitmask.py tests/test_pdl.py tests/test_kernels.py 2>&1 \
  | grep -E "Error|assert|passed|failed|FAILED" | tail -12
echo "== structured rows served, qwen3-0.6b dummy, 128 x 128 tokens [$(( $(date +%s) - start )) s]"
timeout 150 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
  --num-requests 128 --max-tokens 128 --prompt-len 64 --rounds 3 --constrained-every 1 4 --grammar-process on \
  --out "$OUT/structured.json" 2>&1 | grep -v INFO | tail -12
echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
if (( $(left) > 100 )); then
  timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 \
    --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
fi
echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
if (( $(left) > 110 )); then
  timeout 110 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
    --latency-prompt-len 512 --timeout 100 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -5
fi
echo "== done [$(( $(date +%s) - start )) s]"
