#!/usr/bin/env bash
# Session 34, call 3: issues 20 and 25's figures on the committed tree (PHASES=figures: llama3-8b FP8 batch-1,
# qwen3-0.6b with a bf16 and an fp8 KV cache, trtllm-1000, deepseek-v2-lite reference + batch-1).
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PHASES=figures OUT=$OUT bash bench/gpu_check.sh 2>&1 | grep -v "^NVIDIA\|^torch"
