#!/usr/bin/env bash
# Session 43, call 1 (an H100 came for an H200 call and stayed warm). The model tests of the MoE / MLA / GLM work
# of this session on CUDA (Triton kernels, not the interpreter): every test in these files, gpu-marked or not.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp -n "$f" "${f//NVIDIA_H200/$card}"; done
files="tests/test_moe_mla_features_qa.py tests/test_glm4_moe.py tests/test_deepseek.py"
echo "== $files on $card [$(( $(date +%s) - start )) s]"
timeout $(( 260 - ($(date +%s) - start) )) python3 -m pytest -q -p no:cacheprovider -o pythonpath= -rfE --tb=short \
  --continue-on-collection-errors --durations=10 $files -k "not test_deepseek.py or matches_transformers or triton_model" 2>&1 | tee "$OUT/model_tests.txt" \
  | grep -E "^(ERROR|FAILED|E  )|passed|failed|error|s call" | tail -60
echo "== done [$(( $(date +%s) - start )) s]"
