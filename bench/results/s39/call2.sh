#!/usr/bin/env bash
# Session 39, call 2: (1) call 1's GPU tests again after the conftest fix (a collection at each test's end on CUDA:
# call 1 ran out of memory in 6 paged-attention tests after test_async_scheduling's ~70 GiB engine); (2) constrained
# rows served (bench/structured.py, fixed); (3) the session's start (e970e98, "base") against this tree ("head"),
# alternating in one call on one card: llama3-8b FP8 batch-1 and deepseek-v2-lite reference + batch-1 (call 1's
# figures were 2-3% below session 38's on another H100; this separates the tree from the instance).
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
# the base tree beside the head's install (.snap/base.tgz: git archive e970e98)
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .snap/base.tgz -C /tmp/base
(cd /tmp/base && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-base . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-base/ 2>/dev/null; done
for site in /tmp/site /tmp/site-base; do
  if [[ $card != NVIDIA_H200 ]]; then
    for f in $site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  fi
done
[[ $card != NVIDIA_H200 ]] && echo "H200 tables installed as $card"
export PYTHONPATH=/tmp/site:/tmp/tests-path
echo "== GPU tests [$(( $(date +%s) - start )) s]"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rf --tb=short \
  tests/test_sampler.py tests/test_sampler_kernel_path.py tests/test_sampler_warmup.py tests/test_beam_device.py \
  tests/test_async_scheduling.py tests/test_grammar_bitmask.py tests/test_pdl.py tests/test_kernels.py 2>&1 \
  | grep -E "Error|assert|passed|failed|FAILED" | tail -12
echo "== structured rows served, qwen3-0.6b dummy, 128 x 128 tokens [$(( $(date +%s) - start )) s]"
timeout 120 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
  --num-requests 128 --max-tokens 128 --prompt-len 64 --rounds 3 --constrained-every 1 4 --grammar-process on \
  --out "$OUT/structured.json" 2>&1 | grep -v INFO | tail -7
for tree in base head base head; do
  site=/tmp/site; [[ $tree == base ]] && site=/tmp/site-base
  if (( $(date +%s) - start < 470 )); then
    echo "== $tree: llama3-8b fp8 batch-1 after 512 tokens [$(( $(date +%s) - start )) s]"
    PYTHONPATH=$site timeout 60 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy \
      --quantization fp8 --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 \
      --latency-prompt-len 512 --timeout 55 --out "$OUT/ab_${tree}_llama3-8b_fp8_b1.json" 2>&1 | tail -1
  fi
  if (( $(date +%s) - start < 500 )); then
    echo "== $tree: deepseek-v2-lite reference + batch-1 [$(( $(date +%s) - start )) s]"
    PYTHONPATH=$site timeout 70 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy \
      --workload reference --latency-prompt-len 512 --timeout 65 --out "$OUT/ab_${tree}_deepseek-v2-lite.json" 2>&1 \
      | grep -E "^pagoda |batch-1"
  fi
done
echo "== done [$(( $(date +%s) - start )) s]"
