#!/usr/bin/env bash
# Session 38, call 4: the cost of the logit bias going in before the repetition penalty (b8e7a63: an fp32 copy of
# the logits, biased, when a row has both): bench/sampler_bench.py at B=256 with OpenAI sampling alone, with a
# repetition penalty, with a logit bias, and with both, three times each over. On an H200 first, llama3-8b o retuned
# at 64 / 128 rows (the H200's cells, 0.95x / 0.85x in the thirty-second session; commit $OUT/tune_o/w8a16_table.json
# under kernels/fp8_configs/ if it wins). On another card the H200's tables are installed under its name first.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tests-path TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card != NVIDIA_H200 ]]; then
  for f in /tmp/site/pagoda/kernels/*_configs/*NVIDIA_H200*.json; do cp "$f" "${f//NVIDIA_H200/$card}"; done
  echo "H200 tables installed as $card"
else
  echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
  timeout 150 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
    2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
fi
for round in 1 2 3; do
  echo "== sampler step, B=256, round $round [$(( $(date +%s) - start )) s]"
  timeout 90 python3 -m pagoda.bench.sampler_bench --settings openai openai_rep openai_bias openai_rep_bias \
    --iters 50 2>&1 | grep -v "^{" | tail -9
  mv "$OUT/sampler_bench.json" "$OUT/sampler_bench_$round.json" 2>/dev/null || true
done
echo "== done [$(( $(date +%s) - start )) s]"
