#!/usr/bin/env bash
# Session 44, call 1. On an H200: session 42's call 2 (the H200-only issue figures). On an H100: session 43's call 1
# (the MoE / MLA QA, GLM and DeepSeek test files on CUDA), which never got a machine.
OUT=${OUT:-/tmp/out}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
if [[ $card == *H200* ]]; then
  bash bench/results/s42/call2.sh
else
  bash bench/results/s43/call1.sh
fi
