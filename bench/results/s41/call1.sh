#!/usr/bin/env bash
# Session 41, call 1: session 40's call 4 (it never ran then); on an H200 first llama3-8b's o retuned at 64 / 128. prev = 1b39a4c (session 39's end), head = 6a9e824.
# Session 40, call 4: the session's grammar and streaming changes on a GPU, against session 39's end (prev =
# 1b39a4c): (1) the grammar GPU tests; (2) constrained rows served (bench/structured.py, qwen3-0.6b dummy, SmolLM2's
# tokenizer, grammar process on, 128 x 128 tokens, every row constrained and one in four), prev / head / prev / head:
# llguidance's tokenizer is now built from the token bytes with a Python encoder for forced text (f4482d5);
# (3) served openai-style traffic (as call 1, one counted round of 512 prompts a start) prev / head / prev / head,
# with each process's CPU per 1,000 output tokens: the tokenizer's and api's per-token changes of this session.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
if [[ $card == NVIDIA_H200 ]]; then  # first the H200's o cells at 64 / 128 rows (0.95x / 0.85x in session 32)
  echo "== llama3-8b o retuned at 64 / 128 rows, then swept [$(( $(date +%s) - start )) s]"
  PYTHONPATH=/tmp/site timeout 150 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 \
    --out "$OUT/tune_o" 2>&1 | grep -E "^(tune|sweep|FP8)" | cut -c1-240
  start=$(date +%s)  # the served parts' time limits count from here
fi
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
echo "== grammar GPU tests [$(( $(date +%s) - start )) s]"
PYTHONPATH=/tmp/site:/tmp/tests-path timeout 90 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rf \
  --tb=short tests/test_grammar_bitmask.py tests/test_grammar_process.py tests/test_grammar_vocab.py 2>&1 | tail -6
for tree in prev head prev head; do
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  (( $(date +%s) - start > 150 )) && break
  echo "== $tree: structured rows served [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 90 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy \
    --tokenizer .gpu/smollm2-tok --num-requests 128 --max-tokens 128 --prompt-len 64 --rounds 2 \
    --constrained-every 1 4 --grammar-process on --out "$OUT/structured_$tree.json" 2>&1 | grep "tok/s" | tail -3
done
cpu_snapshot() {  # "role ticks" per pagoda process
  for pid in $(pgrep -f "pagoda.services."); do
    role=$(tr '\0' ' ' < /proc/$pid/cmdline | grep -o "pagoda.services.[a-z_.]*" | head -1 | sed 's/pagoda.services.//')
    ticks=$(awk '{print $14 + $15}' /proc/$pid/stat 2>/dev/null) || continue
    echo "$role $ticks"
  done | sort
}
round=0
for tree in prev head prev head; do
  round=$((round + 1))
  (( $(date +%s) - start > 230 )) && break
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  port=$((8180 + round))
  PYTHONPATH=$site python3 -m pagoda.cli serve --model qwen3-0.6b --load-format dummy --tokenizer .gpu/smollm2-tok \
    --port $port > /tmp/serve_${tree}_$round.log 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  echo "== $tree: served openai (start $round) [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 60 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model qwen3-0.6b \
    --workload openai --num-prompts 64 --vocab-size 49000 --concurrency 64 > /dev/null 2>&1
  before=$(cpu_snapshot)
  PYTHONPATH=$site timeout 90 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model qwen3-0.6b \
    --workload openai --num-prompts 512 --rounds 8 --vocab-size 49000 --concurrency 64 \
    --out "$OUT/served_${tree}_$round.json" 2>&1 | grep "^c=64" | sed "s/^/$tree $round /"
  after=$(cpu_snapshot)
  tokens=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); l=d['levels'][0]; print(round(l['output_tok_per_s'] * l['elapsed_s']))" "$OUT/served_${tree}_$round.json" 2>/dev/null)
  join <(echo "$before") <(echo "$after") | grep -v grammar | awk -v t="$tokens" \
    '{d=($3-$2)/100.0; printf "  cpu %-10s %6.2f s", $1, d; if (t>0) printf "  %.3f ms/1k tok", 1e6*d/t; printf "\n"}'
  kill -TERM $server; wait $server
done
echo "== done [$(( $(date +%s) - start )) s]"
