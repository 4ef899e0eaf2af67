#!/usr/bin/env bash
# Session 31, call 1: the untimed switches' A/B (candidates-ab), then the swap GPU test.
OUT=${OUT:-/tmp/out} PHASES=candidates-ab bash bench/gpu_check.sh 2>&1 | tail -80
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_async_scheduling.py -m gpu \
  -k "swapped or async_equals" -rs 2>&1 | tail -4
