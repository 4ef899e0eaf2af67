#!/usr/bin/env bash
# Session 47, call 2 (after call 1 = bench/results/s42/call1.sh on an H200, same machine if still warm): the two
# issue figures that were met in some runs and missed in others, once more on one machine: llama3-8b FP8 + FP8 KV
# on TensorRT-LLM's table (trtllm-1000; 17,272-18,116 against 17,744) and deepseek-v2-lite's reference workload
# (0.67-0.709 of its floor against 0.7). On another card: stop.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
left() { echo $(( 560 - ($(date +%s) - start) )); }
if [[ $card != NVIDIA_H200 ]]; then
  echo "== not an H200 ($card): done [$(( $(date +%s) - start )) s]"; exit 0
fi
echo "== llama3-8b fp8 + fp8 kv, trtllm-1000 [$(( $(date +%s) - start )) s]"
timeout 240 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
  --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 220 --out "$OUT/trtllm-1000.json" 2>&1 \
  | grep -v "^[a-z-]*: {" | tail -3
for run in 1 2; do
  echo "== deepseek-v2-lite reference, run $run [$(( $(date +%s) - start )) s]"
  if (( $(left) > 100 )); then
    timeout 100 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
      --timeout 90 --out "$OUT/deepseek-v2-lite_reference_$run.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -3
  fi
done
echo "== done [$(( $(date +%s) - start )) s]"
