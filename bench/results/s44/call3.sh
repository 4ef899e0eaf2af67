#!/usr/bin/env bash
# Session 44, call 3. On an H200 only: session 42's call 2 (llama3-8b's o retuned at 64 / 128 rows, llama3-8b FP8
# batch-1, deepseek-v2-lite reference + batch-1). Calls 1-2 ran the CUDA model tests on an H100; another card stops.
bash bench/results/s42/call2.sh
