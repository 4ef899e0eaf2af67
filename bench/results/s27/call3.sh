# call 3: the MoE GEMV buckets (1, 2 tokens) retuned cold for deepseek-v2-lite and qwen3-30b-a3b, then v2-lite batch-1
set -u
timeout 330 python3 -m pagoda.bench.moe_tune --shapes deepseek-v2-lite,qwen3-30b-a3b --buckets 1,2 --write \
  --out "$OUT/moe_tune.json" 2>&1 | grep -v '^{' | grep -v "^  skip" | tail -16
mkdir -p "$OUT/moe_configs" && cp /tmp/site/pagoda/kernels/moe_configs/*.json "$OUT/moe_configs/"
echo "## v2-lite batch-1 with the new table"
timeout 150 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --num-prompts 8 \
  --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 140 \
  --out "$OUT/v2lite_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
