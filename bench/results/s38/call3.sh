#!/usr/bin/env bash
# Session 38, call 3, on the final tree: (1) the GPU tests of what this session changed: the sampler (logit bias
# before the repetition penalty, on the Triton path too: b8e7a63), beam search on the device, and the kernels whose
# measurement switches now come from pagoda.shared.config (0c0381e: paged attention, PDL, FP8, MoE, MLA); (2) the
# sampler's step time with a repetition penalty and a logit bias on every row (bench/sampler_bench.py
# openai_rep_bias: the path b8e7a63 added) beside plain OpenAI sampling (T 0.7, top_p 0.95, no top_k); (3) as the
# time left allows, llama3-8b FP8 batch-1 and deepseek-v2-lite reference + batch-1 (issue figures).
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
echo "== GPU tests [$(( $(date +%s) - start )) s]"
timeout 300 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rf --tb=short \
  tests/test_sampler.py tests/test_sampler_kernel_path.py tests/test_sampler_warmup.py tests/test_beam_device.py \
  tests/test_kernels.py tests/test_fp8.py tests/test_kv_fp8.py tests/test_moe.py tests/test_mla.py \
  tests/test_deepseek.py tests/test_pdl.py tests/test_qkv_prep.py 2>&1 | grep -E "Error|assert|passed|failed|FAILED" | tail -12
echo "== sampler step, B=256: openai against openai + repetition penalty + logit bias [$(( $(date +%s) - start )) s]"
timeout 90 python3 -m pagoda.bench.sampler_bench --settings greedy openai sampled openai_rep_bias --iters 30 2>&1 \
  | grep -v "^{" | tail -10
left() { echo $(( 570 - ($(date +%s) - start) )); }
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
