#!/usr/bin/env bash
# Session 40, call 2: the fix (3d4a728: the api tallies inter-token latency once a token and adds it to both
# names' histograms in bulk) against session 39's start and end, as call 1: base = e970e98, prev = 1b39a4c,
# head = this snapshot. qwen3-0.6b dummy behind `pagoda serve` (SmolLM2's tokenizer), the openai workload (T 0.7,
# top_p 0.95, no top_k), concurrency 64; per server start a 64-prompt warm-up, then two counted rounds of 512
# prompts with each pagoda process's CPU seconds (utime + stime from /proc) per 1,000 output tokens.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for tree in base prev; do
  rm -rf /tmp/$tree && mkdir -p /tmp/$tree && tar xzf .snap/$tree.tgz -C /tmp/$tree
  (cd /tmp/$tree && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
    --target /tmp/site-$tree . >/dev/null 2>&1)
  for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-$tree/ 2>/dev/null; done
done
cpu_snapshot() {  # "role ticks" per pagoda process
  for pid in $(pgrep -f "pagoda.services."); do
    role=$(tr '\0' ' ' < /proc/$pid/cmdline | grep -o "pagoda.services.[a-z_.]*" | head -1 | sed 's/pagoda.services.//')
    ticks=$(awk '{print $14 + $15}' /proc/$pid/stat 2>/dev/null) || continue
    echo "$role $ticks"
  done | sort
}
round=0
for tree in base head prev head base prev head; do
  round=$((round + 1))
  (( $(date +%s) - start > 500 )) && break
  site=/tmp/site; [[ $tree != head ]] && site=/tmp/site-$tree
  port=$((8160 + round))
  PYTHONPATH=$site python3 -m pagoda.cli serve --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
    --port $port > /tmp/serve_${tree}_$round.log 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  echo "== $tree (start $round) [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 60 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model qwen3-0.6b \
    --workload openai --num-prompts 64 --vocab-size 49000 --concurrency 64 > /dev/null 2>&1
  for k in 1 2; do
    before=$(cpu_snapshot)
    PYTHONPATH=$site timeout 90 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model qwen3-0.6b \
      --workload openai --num-prompts 512 --rounds 8 --vocab-size 49000 --concurrency 64 \
      --out "$OUT/${tree}_${round}_$k.json" 2>&1 | grep "^c=64" | sed "s/^/$tree $round.$k /"
    after=$(cpu_snapshot)
    tokens=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); l=d['levels'][0]; print(round(l['output_tok_per_s'] * l['elapsed_s']))" "$OUT/${tree}_${round}_$k.json" 2>/dev/null)
    join <(echo "$before") <(echo "$after") | awk -v t="$tokens" -v tree=$tree -v r=$round.$k \
      '{d=($3-$2)/100.0; printf "  cpu %s %s %-10s %6.2f s", tree, r, $1, d; if (t>0) printf "  %.3f ms/1k tok", 1e6*d/t; printf "\n"}'
  done
  kill -TERM $server; wait $server
done
echo "== done [$(( $(date +%s) - start )) s]"
