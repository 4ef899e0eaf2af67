#!/usr/bin/env bash
# Session 42, call 4 (H100): the grammar gate served on a GPU (grammar process on, as CUDA hosts run it): a
# stream's longest gap between tokens while a request with a 6,000-property schema comes, prev (cb31063) / head.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
round=0
for tree in prev head; do
  round=$((round + 1))
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  port=$((8190 + round))
  PYTHONPATH=$site python3 -m pagoda.cli serve --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
    --port $port > /tmp/serve_$tree.log 2>&1 &
  server=$!
  for _ in $(seq 150); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  sleep 3  # the tokenizer registers after /health answers
  echo "== $tree [$(( $(date +%s) - start )) s]"
  timeout 150 python3 bench/results/s42/gate_served.py $port 6000 2>&1 | cut -c1-400
  grep -E "WARNING|ERROR" /tmp/serve_$tree.log | cut -c1-200 | tail -4
  kill -TERM $server; wait $server
done
echo "== done [$(( $(date +%s) - start )) s]"
