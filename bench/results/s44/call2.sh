#!/usr/bin/env bash
# Session 44, call 2 (the H100 of call 1, warm). Call 1's 260 s ran 29 tests of the MoE / MLA QA file on CUDA, all
# passed, and no summary came. Here: the GLM and DeepSeek files (DeepSeek's transformers-parity and Triton-model
# tests), then the rest of the QA file, to 520 s.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp --update=none "$f" "${f//NVIDIA_H200/$card}"; done
files="tests/test_glm4_moe.py tests/test_deepseek.py tests/test_moe_mla_features_qa.py"
echo "== $files on $card [$(( $(date +%s) - start )) s]"
timeout $(( 520 - ($(date +%s) - start) )) python3 -m pytest -v -p no:cacheprovider -o pythonpath= -rfE --tb=short \
  --durations=10 $files -k "not test_deepseek.py or matches_transformers or triton_model" 2>&1 \
  | tee "$OUT/model_tests.txt" | grep -E "^(ERROR|FAILED|E  )|PASSED|passed|failed|error|s call" | cut -c1-160 | tail -80
echo "== done [$(( $(date +%s) - start )) s]"
