#!/usr/bin/env bash
# Session 50, call 1. On an H200: session 48's unrun H200 work (bench/results/s48/call1.sh: the o retune at 64 / 128
# rows, llama3-8b FP8 batch-1, deepseek-v2-lite reference + batch-1). On another card: name it and stop, so that the
# machine can go back at once.
OUT=${OUT:-/tmp/out}
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card == NVIDIA_H200 ]]; then exec bash bench/results/s48/call1.sh; fi
echo "== not an H200 ($card): nothing run"
