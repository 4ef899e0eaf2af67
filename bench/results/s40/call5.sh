#!/usr/bin/env bash
# NOT RUN: the device refused this call (four times for call 4; call 5 found too little device time left).
# Session 40, call 5 (the budget's last ~245 s): constrained rows served, session 39's end (prev = 1b39a4c) against
# this tree (llguidance's tokenizer built from token bytes with a Python encoder for forced text, f4482d5; the
# forced start walked at submission, 4850ed0). bench/structured.py: qwen3-0.6b dummy, SmolLM2's tokenizer, grammar
# process on, 128 x 128 tokens, every row constrained; prev then head, one round each.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
for tree in prev head; do
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  echo "== $tree: structured rows served [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 75 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy \
    --tokenizer .gpu/smollm2-tok --num-requests 128 --max-tokens 128 --prompt-len 64 --rounds 1 \
    --constrained-every 1 --grammar-process on --out "$OUT/structured_$tree.json" 2>&1 | grep "tok/s" | tail -2
done
echo "== done [$(( $(date +%s) - start )) s]"
