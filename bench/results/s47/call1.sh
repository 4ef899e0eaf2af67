#!/usr/bin/env bash
# Session 47, call 1, any card. (1) min-p before top-p (9013550) on CUDA: test_sampler.py's gpu tests and the whole
# of test_sampler_kernel_path.py (full block sizes on CUDA). (2) On an H200 only: the unrun H200 work of sessions
# 41-46 (llama3-8b's o retuned at 64 / 128 rows, where FP8 was 0.95x / 0.85x bf16; llama3-8b FP8 batch-1; then
# deepseek-v2-lite reference + batch-1 as time allows). (3) The sampler step, prev (6533855) / head, at "mixed"
# (min-p rows beside OpenAI-style top-p rows) and "openai", with the time left.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
left() { echo $(( 560 - ($(date +%s) - start) )); }
echo "== sampler GPU tests [$(( $(date +%s) - start )) s]"
PYTHONPATH=/tmp/site:/tmp/tests-path timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -rf \
  --tb=short -m "gpu or not gpu" tests/test_sampler_kernel_path.py "tests/test_sampler.py::test_kernels_match_reference_gpu" \
  "tests/test_sampler.py::test_gpu_sample_matches_cpu_sample" 2>&1 | tail -6
export PYTHONPATH=/tmp/site:/tmp/tests-path
if [[ $card == NVIDIA_H200 ]]; then
  echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
  timeout 170 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
    2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
  echo "== llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
  if (( $(left) > 150 )); then
    timeout 100 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
      --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 90 \
      --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
  fi
  echo "== deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
  if (( $(left) > 150 )); then
    timeout 110 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
      --latency-prompt-len 512 --timeout 100 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
      | grep -v "^[a-z-]*: {" | tail -5
  fi
fi
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
for tree in prev head prev head; do
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  (( $(left) < 45 )) && break
  echo "== $tree: sampler step [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 40 python3 -m pagoda.bench.sampler_bench --settings mixed openai --iters 50 2>&1 | tail -5
done
echo "== done [$(( $(date +%s) - start )) s]"
