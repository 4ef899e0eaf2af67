#!/usr/bin/env bash
# Session 34, call 2: issue 25 item 3's two missing kinds of cell: llama3-8b's o retuned at 64 and 128 rows with
# the norm after it (PHASES=fp8-o, then its sweep with that table), and the MoE expert shapes' FP8 against bf16
# (PHASES=moe-fp8, never run on a GPU before).
OUT=${OUT:-/tmp/out}
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PHASES=moe-fp8 OUT=$OUT bash bench/gpu_check.sh 2>&1 | grep -v "^NVIDIA\|^torch"
PHASES=fp8-o OUT=$OUT bash bench/gpu_check.sh 2>&1 | grep -v "^NVIDIA\|^torch"
ls "$OUT/tune_o" 2>/dev/null
