#!/usr/bin/env bash
# Session 42, call 3 (an H100 again): the grammar gate (a6ba6a8) on a GPU. (1) The grammar and async-scheduling GPU
# tests at this tree; (2) constrained rows served (bench/structured.py: qwen3-0.6b dummy, SmolLM2's tokenizer,
# grammar process on, 128 x 128 tokens, every row constrained and one in four), prev (cb31063, the session's start)
# / head / prev / head: every GrammarDef is now compiled as it comes (MaskPrepare -> MaskCompiled) and the worker
# reads the grammar process while idle; the schema is below 4 KiB, so no request is held.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
echo "== GPU tests [$(( $(date +%s) - start )) s]"
PYTHONPATH=/tmp/site:/tmp/tests-path timeout 150 python3 -m pytest -q -p no:cacheprovider -o pythonpath= -m gpu -rf \
  --tb=short tests/test_grammar_bitmask.py tests/test_grammar_vocab.py tests/test_async_scheduling.py 2>&1 | tail -4
for tree in prev head prev head; do
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  (( $(date +%s) - start > 420 )) && break
  echo "== $tree: structured rows served [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 100 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy \
    --tokenizer .gpu/smollm2-tok --num-requests 128 --max-tokens 128 --prompt-len 64 --rounds 2 \
    --constrained-every 1 4 --grammar-process on --out "$OUT/structured_$tree.json" 2>&1 | grep "tok/s" | tail -3
done
echo "== done [$(( $(date +%s) - start )) s]"
