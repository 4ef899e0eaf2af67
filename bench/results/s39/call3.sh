#!/usr/bin/env bash
# Session 39, call 3: served traffic, the session's start (e970e98, "base") against its end ("head"), one card:
# qwen3-0.6b dummy behind `pagoda serve` (1 api, 1 tokenizer, SmolLM2's tokenizer), the openai workload (T 0.7,
# top_p 0.95, no top_k), 256 prompts at concurrency 64, base / head / base / head. This session changed the served
# per-step path (the scheduler service's phase stamps per row, drop-only plans at idle; the api's vLLM-named
# observations per delta).
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/base && mkdir -p /tmp/base && tar xzf .snap/base.tgz -C /tmp/base
(cd /tmp/base && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-base . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-base/ 2>/dev/null; done
round=0
for tree in base head base head; do
  round=$((round + 1))
  (( $(date +%s) - start > 470 )) && break
  site=/tmp/site; [[ $tree == base ]] && site=/tmp/site-base
  port=$((8130 + round))
  PYTHONPATH=$site python3 -m pagoda.cli serve --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
    --port $port > "$OUT/serve_${tree}_$round.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  echo "== $tree (round $round) [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 100 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model qwen3-0.6b \
    --workload openai --num-prompts 256 --vocab-size 49000 --concurrency 64 \
    --out "$OUT/serve_${tree}_$round.json" 2>&1 | tail -4
  kill -TERM $server; wait $server
done
echo "== done [$(( $(date +%s) - start )) s]"
