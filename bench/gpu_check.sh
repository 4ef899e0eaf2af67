#!/usr/bin/env bash
# One device call: install the carried wheels and the project, run the GPU tests, greedy parity against
# transformers, the offline throughput benchmark (pagoda and the Hugging Face peers, each in its own
# process) on qwen3-0.6b and llama3-8b, and print a short table last.
#   PHASES=tests,gpu-tests,probe,parity,pagoda,peers,compiled,cb,workloads,serve,moe-tune,moe,long,deepseek,
#   deepseek-profile,fp8,kv-fp8,structured,candidates,dense-gemv,act-fp8,moe-sum,figures,llama-fp8,attention,mla-lazy,
#   one-loop,gluon,moe-fp8,fp8-o,split-k-ab,moe-act-fp8 (default: tests,parity,pagoda,peers,compiled)
#   moe-act-fp8: the W8A8 grouped GEMM's GPU test, then FP8 experts tuned (bench/moe_tune.py --weights fp8: every
#   tile weight-only and W8A8, per GEMM) at 128-8192 tokens on deepseek-v2-lite and qwen3-30b-a3b into their FP8
#   tables (installed; commit $OUT/moe_fp8_tables/*.json under kernels/moe_configs/), then the sweep against bf16 with
#   those tables and with weight-only forced (PAGODA_MOE_ACT_FP8=0). Weight-only FP8 experts were 0.66-0.98x of bf16
#   at 1024-8192 tokens on an H100, 2026-12-05.
#   split-k-ab: llama3-8b FP8 decode steps at 1-64 rows (step_ab, graph-timed, logits compared) with the weight-only
#   layers' split-K sums in separate kernels (PAGODA_FUSE_SPLIT_K=0), in the norms only (=norms: the fourteenth
#   session's fusion, plus the norm that quantizes for a W8A8 GEMM after it) and also in qkv prep (the default).
#   fp8-o: retune llama3-8b's o projection at 64 and 128 rows (the two cells where FP8 was slower than bf16 in the
#   thirty-second session's sweep; candidates compiled in parallel first; since the thirty-third session o and
#   down are tuned with the residual norm after them, which takes split-K partials), then sweep o with that table
#   (commit $OUT/tune_o/w8a16,*.json under kernels/fp8_configs/ if it wins).
#   moe-fp8: FP8 experts against bf16 at 1-8192 tokens on deepseek-v2-lite and qwen3-30b-a3b (bench/moe_fp8_sweep.py,
#   issue 25 item 3's MoE rows), cold weights, committed tiles.
#   gluon: qwen3-0.6b reference with a bf16 and an fp8 cache, trtllm-1000, llama3-8b FP8 + FP8 KV reference and
#   OpenAI-sampled (the runs the Gluon fp8 decode kernel moves).
#   one-loop: the decode launch with every key tile in one masked loop (kv_fp8_bench --long, ONE_LOOP_ONLY), then
#   qwen3-0.6b reference with a bf16 and an fp8 cache.
#   figures: issues 20 and 25's figures on the committed tree, no tuning: llama3-8b FP8 batch-1, qwen3-0.6b with a
#   bf16 and an fp8 KV cache, TensorRT-LLM's 1000/1000 row, deepseek-v2-lite reference + batch-1 (~8 minutes).
#   attention: the decode attention launches against the previous ones (kv_fp8_bench --long), then qwen3-0.6b
#   reference with both caches, llama3-8b bf16 reference and trtllm-1000 (~6 minutes).
#   mla-lazy: the MLA decode launch with and without its softmax sums per key slot (mla_bench --parts lazy), then
#   deepseek-v2-lite reference + batch-1.
#   llama-fp8: llama3-8b FP8's decode step at B = 1, 2, 4 (SiLU in the down GEMV at one row or never; kernels at
#   B=1), then its reference workload with a bf16 and an fp8 KV cache and the latter under OpenAI-style sampling.
#   moe-sum: step_ab of PAGODA_FUSE_MOE_SUM (the sparse layers' top-k sum in the next norm) on deepseek-v2-lite
#   (B = 64, 256) and qwen3-30b-a3b (B = 256), then deepseek-v2-lite's reference workload with it.
#   act-fp8: tune the W8A16 kernel's act_fp8 tiles (W8A8 with the activation tile quantized in the kernel) at 1-256
#   rows against the committed table (fp8_tune --act-fp8-only; commit $OUT/tune_act/w8a16_table.json under
#   kernels/fp8_configs/ where they won), the sweep against bf16 with that table, then llama3-8b FP8 on the reference
#   workload (its decode steps run 256 rows) and batch-1.
#   dense-gemv: tune the 16-bit GEMV (bench/gemv_tune.py, DENSE_MODELS, DENSE_BUCKETS) against cuBLAS, install the
#   table (commit $OUT/gemv_tune/dense_table.json under kernels/gemv_configs/), then bench/step_ab.py with
#   PAGODA_DENSE_GEMV=0 / the tuned dispatch / 1 on DENSE_MODELS_AB at B = DENSE_BATCHES (default 1,4;
#   DENSE_BUCKETS defaults to 1: untuned buckets stay on cuBLAS, so B = 4 checks that nothing else changed). For
#   decode batches: DENSE_MODELS=deepseek-v2-lite DENSE_MODELS_AB=deepseek-v2-lite DENSE_BUCKETS=128,256
#   DENSE_BATCHES=128,256 (at 256 rows its sparse layer's cuBLAS GEMMs took 4.6-9.7 us a launch in the s27
#   profile; by bytes and FLOPs [kv_a ‖ q] needs ~5 us, o ~3).
#   candidates: the untimed candidates of the seventeenth and eighteenth sessions, in one call: the fp8-KV decode
#   launch with 2 / 8 warps and 32-key tiles and QK^T on fp8 tensor cores with q as one or two e4m3 terms
#   (kv_fp8_bench; then whole decode steps with PAGODA_FP8_KV_DECODE, step_ab), SiLU fused into the FP8 down GEMV
#   (step_ab, PAGODA_FUSE_SILU_GEMV). deepseek-v2-lite's batch-1 step by kernel: PHASES=deepseek-profile.
#   gpu-tests: every test marked gpu in GPU_TEST_FILES (default: the kernel, fp8, MoE, MLA, DeepSeek, PDL and qkv-prep
#   files; not the whole tests/ folder, some of whose modules import what the device lacks). GPU_TEST_MARK= runs
#   every test of the files (on the GPU where they use one); GPU_TEST_TIMEOUT (default 400 s).
#   deepseek-profile: deepseek-v2-lite's layers kernel by kernel at DEEPSEEK_PROFILE_BATCHES (default 1).
#   kv-fp8: bench/kv_fp8_bench.py on KV_FP8_ONLY (fp8 KV decode and chunk variants against bf16), KV_FP8_ARGS (e.g.
#   --quick), the last KV_FP8_TAIL lines.
#   structured: bench/structured.py, 256 rows x 256 tokens, 6 rounds, every row and a quarter constrained, with
#   each mode's GPU busy and mask latency; with the grammar process and with the mask thread; then
#   bench/grammar_step.py (host only: the process's round trip) and
#   bench/fast_forward.py (a grammar's forced start prefilled or sampled step by step).
#   moe-tune: tune the fused MoE kernel's tiles (MOE_SHAPES), check it, report bandwidth / matmul rate, write the
#   tables ($OUT/moe_configs/*.json; commit them under kernels/moe_configs/). moe: the reference, sampled and batch-1
#   runs on each MOE_SHAPES shape. long: LONG_WORKLOADS ("long-128k long-32k") on LONG_SHAPE (qwen3-8b-yarn).
#   deepseek: the MLA / DeepSeek GPU tests, the MLA kernels (decode bandwidth, absorbed-vs-expanded prefill
#   crossover, latent capacity; MLA_SWEEP=1 adds the decode launch-shape sweep) and deepseek-v3-slice's per-layer
#   decode time at B = 1, 64, 256 against its floor (FP8 block weights). deepseek-v2-lite's reference, sampled and
#   batch-1 runs: PHASES=moe MOE_SHAPES=deepseek-v2-lite.
#   fp8: tune the weight-only FP8 GEMV (bench/fp8_tune.py: tiles per shape and M bucket, then the sweep against bf16;
#   the table goes to $OUT/tune/ and is installed for the runs after it: commit it under kernels/fp8_configs/), then
#   llama3-8b bf16 / fp8 / fp8 + fp8 KV (reference workload + batch-1), TensorRT-LLM's 1000/1000 row, and qwen3-0.6b
#   with a bf16 and an fp8 KV cache.
#   SHAPES="qwen3-0.6b llama3-8b" (the default)   PARITY_VARIANTS=pagoda-torch-ops,hf-efficient,hf-eager (default none)
#   WORKLOADS="reference sampled shared-prefix long n4" (the workloads phase; bench/workload.py)
#   TOKENIZER=dir of a real tokenizer for the serve phase (default .gpu/smollm2-tok: the SmolLM2 folder without
#   its weights); SERVE_CONCURRENCY=1,16,64,256  SERVE_RATES=4,8,16,32,64  SERVE_PROMPTS=256 (per level)
#   OUT=dir for JSON logs
# Carry .whl (pyzmq, msgspec, llguidance wheels for cp312; README "Notes") and .gpu (the tokenizer) with the call.
# pytest runs with -o pythonpath= : the ini's "." would put the checkout's pagoda/ folder (no kernels/, services/)
# before the installed package.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagoda-gpu}
PHASES=${PHASES:-tests,parity,pagoda,peers,compiled}
mkdir -p "$OUT"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . || exit 1
# tests.* helpers (tests/parity.py) importable without the checkout's root on the path (its kernels/ folder would
# pass for Hugging Face's `kernels` package, its pagoda/ for the installed one)
mkdir -p /tmp/tests-path && ln -sfn "$PWD/tests" /tmp/tests-path/tests
export PYTHONPATH=/tmp/site:/tmp/tests-path
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
has() { [[ ",$PHASES," == *",$1,"* ]]; }
WORKLOAD=(--num-prompts 256 --input-len 512 --input-len-jitter 0 --output-len 256 --load-format dummy)
qwen3_kv_pair() {  # qwen3-0.6b's reference workload with a bf16 and an fp8 KV cache, the median of KV_PAIR_REPEATS
  # (default 5) runs each (a run lasts ~1.5 s: single runs moved by up to 8%); $1: the JSON files' prefix
  for kv in auto fp8; do
    echo "== qwen3-0.6b reference, kv $kv"
    timeout 120 python3 -m pagoda.bench throughput --model qwen3-0.6b "${WORKLOAD[@]}" --kv-cache-dtype $kv \
      --repeats "${KV_PAIR_REPEATS:-5}" --timeout 110 --out "$OUT/$1_qwen3-0.6b_kv_$kv.json" 2>&1 \
      | grep -v "^[a-z-]*: {" | tail -4
  done
}
trtllm_1000() {  # llama3-8b FP8 + FP8 KV on TensorRT-LLM's 1000/1000 workload; $1: the JSON file's prefix
  echo "== llama3-8b fp8 + fp8 kv, trtllm-1000"
  timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --kv-cache-dtype fp8 --workload trtllm-1000 --timeout 180 --out "$OUT/$1_trtllm-1000.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -4
}
moe_sweep_rows() {  # bench/moe_fp8_sweep.py's JSON rows on stdin as one line each, other lines as they are
  python3 -c "import json, sys
for line in sys.stdin:
    if not line.startswith('{'):
        print(line.rstrip()); continue
    r = json.loads(line)
    print(f\"{r['shape']:18s} T={r['tokens']:5d} bf16 {r['bf16_us']:8.1f} us ({r['bf16_hbm_fraction']:.2f} HBM) fp8 \"
          f\"{r['fp8_us']:8.1f} us ({r['fp8_hbm_fraction']:.2f}) {r['speedup_fp8']:.2f}x err {r['fp8_rel_err']:.4f}\"
          + (f\" | fp8 gmm {r['fp8_gmm_us']:8.1f} us {r['speedup_fp8_gmm']:.2f}x err {r['fp8_gmm_rel_err']:.4f}\"
             if 'fp8_gmm_us' in r else ''))"
}
llama_fp8_runs() {  # llama3-8b FP8 runs; $1: the JSON files' prefix, then "workload kv-cache-dtype" pairs
  local prefix=$1 run
  shift
  for run in "$@"; do
    set -- $run
    echo "== llama3-8b fp8, workload $1, kv $2"
    timeout 150 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
      --workload "$1" --kv-cache-dtype "$2" --timeout 140 --out "$OUT/${prefix}_${1}_kv_$2.json" 2>&1 \
      | grep -v "^[a-z-]*: {" | tail -4
  done
}

if has tests; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider -o pythonpath= tests/test_model_kernels.py tests/test_kernels.py \
    -k "${TEST_FILTER:-gpu or graph or model}" 2>&1 | tail -5
fi
if has gpu-tests; then
  mark=${GPU_TEST_MARK-gpu}  # GPU_TEST_MARK= (empty): every test of the files, on the GPU where they use one
  timeout "${GPU_TEST_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -o pythonpath= ${mark:+-m "$mark"} \
    ${GPU_TEST_FILES:-tests/test_kernels.py tests/test_fp8.py tests/test_kv_fp8.py tests/test_moe.py tests/test_mla.py \
      tests/test_deepseek.py tests/test_pdl.py tests/test_qkv_prep.py} \
    2>&1 | tail -5
fi
if has probe; then
  timeout 120 python3 -m pagoda.bench.parity_probe --shape qwen3-0.6b --prompt-len 100 2>&1 \
    | tee "$OUT/probe.txt" | grep -v "^PROBE\|Warning\|forward_call"
fi
if has parity; then
  timeout 300 python3 -m pagoda.bench.gpu_parity --shape qwen3-0.6b --num-prompts 64 --new-tokens 32 \
    --variants "${PARITY_VARIANTS:-}" | tee "$OUT/parity.txt" | grep PARITY
fi
for shape in ${SHAPES:-qwen3-0.6b llama3-8b}; do
  peers=()
  has peers && peers+=(--peer hf-static)
  has compiled && peers+=(--peer hf-compiled)
  has cb && peers+=(--peer hf-cb)
  skip=()
  has pagoda || skip=(--skip-pagoda)
  [[ ${#peers[@]} -eq 0 && ${#skip[@]} -gt 0 ]] && continue
  latency=()
  [[ $shape == llama3-8b ]] && latency=(--latency-prompt-len 512)
  timeout 560 python3 -m pagoda.bench throughput --model "$shape" "${WORKLOAD[@]}" "${skip[@]}" "${peers[@]}" \
    "${latency[@]}" --timeout "${SYSTEM_TIMEOUT:-300}" --out "$OUT/throughput_$shape.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -12  # drop the per-system JSON lines, keep the table
done

if has workloads; then
  for shape in ${SHAPES:-qwen3-0.6b llama3-8b}; do
    for workload in ${WORKLOADS:-reference sampled shared-prefix long n4}; do
      echo "== workload $workload on $shape"
      timeout 400 python3 -m pagoda.bench throughput --model "$shape" --load-format dummy --workload "$workload" \
        --timeout "${SYSTEM_TIMEOUT:-300}" --out "$OUT/workload_${shape}_${workload}.json" 2>&1 \
        | grep -v "^[a-z-]*: {" | tail -4
    done
  done
fi
if has serve; then
  # Served with real text: a dummy shape whose vocabulary shrinks to the tokenizer's; 1 api, 1 tokenizer.
  for shape in ${SHAPES:-qwen3-0.6b llama3-8b}; do
    port=8123
    python3 -m pagoda.cli serve --model "$shape" --load-format dummy --tokenizer "${TOKENIZER:-.gpu/smollm2-tok}" \
      --port $port > "$OUT/serve_$shape.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    echo "== serve $shape (1 api, 1 tokenizer, real text)"
    timeout 420 python3 -m pagoda.bench serve --url "http://127.0.0.1:$port" --model "$shape" --workload reference \
      --num-prompts "${SERVE_PROMPTS:-256}" --vocab-size 49000 --concurrency "${SERVE_CONCURRENCY:-1,16,64,256}" \
      --request-rate "${SERVE_RATES:-}" --out "$OUT/serve_$shape.json" 2>&1 | tail -12
    kill -TERM $server; wait $server
  done
fi

if has moe-tune; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -o pythonpath= tests/test_moe.py -k "half or fp8" 2>&1 | tail -4
  timeout 540 python3 -m pagoda.bench.moe_tune --shapes "$(echo ${MOE_SHAPES:-qwen3-30b-a3b mixtral-8x7b} | tr ' ' ,)" \
    --write --out "$OUT/moe_tune.json" 2>&1 | grep -v '^{' | tail -40  # its "table" entries: the tiles to commit
fi
if has moe; then
  for shape in ${MOE_SHAPES:-qwen3-30b-a3b mixtral-8x7b}; do
    for workload in ${MOE_WORKLOADS:-reference sampled}; do
      latency=()
      [[ $workload == reference ]] && latency=(--latency-prompt-len 512)
      echo "== $workload on $shape"
      timeout 400 python3 -m pagoda.bench throughput --model "$shape" --load-format dummy --workload "$workload" \
        "${latency[@]}" --timeout "${SYSTEM_TIMEOUT:-300}" --out "$OUT/moe_${shape}_${workload}.json" 2>&1 \
        | grep -v "^[a-z-]*: {" | tail -6
    done
  done
fi
if has long; then
  for workload in ${LONG_WORKLOADS:-long-128k long-32k}; do
    echo "== $workload on ${LONG_SHAPE:-qwen3-8b-yarn}"
    timeout 500 python3 -m pagoda.bench throughput --model "${LONG_SHAPE:-qwen3-8b-yarn}" --load-format dummy \
      --workload "$workload" --timeout "${SYSTEM_TIMEOUT:-400}" --out "$OUT/long_${workload}.json" 2>&1 \
      | grep -v "^[a-z-]*: {" | tail -6
  done
fi
if has deepseek; then
  timeout 400 python3 -m pytest -q -x -p no:cacheprovider -o pythonpath= tests/test_mla.py tests/test_deepseek.py \
    -k "gpu or triton_model or routing or prepare" 2>&1 | tail -4
  sweep=()
  [[ -n ${MLA_SWEEP:-} ]] && sweep=(--sweep)
  timeout 560 python3 -m pagoda.bench.mla_bench --quick "${sweep[@]}" --out "$OUT/mla_bench.json" 2>&1 \
    | grep -v "^decode-sweep" | tail -80
  timeout 560 python3 -m pagoda.bench.deepseek_bench --model deepseek-v3-slice --quantization fp8_block \
    --batches 1,64,256 --context 1024 --out "$OUT/deepseek_v3_slice_layers.json" 2>&1 | tail -8
fi
if has fp8; then
  timeout 300 python3 -m pagoda.bench.fp8_tune --out "$OUT/tune" 2>&1 | grep -E "^tune|tuned|slower" | cut -c1-160
  cp "$OUT"/tune/w8a16,*.json /tmp/site/pagoda/kernels/fp8_configs/ && echo "tuned table installed"
  for q in "none" "fp8" "fp8 --kv-cache-dtype fp8"; do
    quant=()
    [[ $q != none ]] && quant=(--quantization $q)
    echo "== llama3-8b ${q}"
    timeout 150 python3 -m pagoda.bench throughput --model llama3-8b "${WORKLOAD[@]}" "${quant[@]}" \
      --latency-prompt-len 512 --timeout 120 --out "$OUT/fp8_llama3-8b_${q// /_}.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -4
  done
  trtllm_1000 fp8
  qwen3_kv_pair fp8
fi
if has fp8-o; then
  timeout 500 python3 -m pagoda.bench.fp8_tune --shapes llama3-8b --layers o --buckets 64,128 --out "$OUT/tune_o" \
    2>&1 | grep -E "^(precompiled|tune|sweep|FP8)" | cut -c1-220
fi
if has moe-act-fp8; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -o pythonpath= tests/test_moe.py -m gpu -k w8a8 2>&1 | tail -2
  echo "== FP8 experts tuned, weight-only and W8A8 tiles"
  timeout 420 python3 -m pagoda.bench.moe_tune --weights fp8 --shapes deepseek-v2-lite,qwen3-30b-a3b \
    --buckets 128,256,512,1024,2048,4096,8192 --write --out "$OUT/moe_tune_fp8.json" 2>&1 \
    | grep -v "^{\|skip\|Warn" | tail -24
  mkdir -p "$OUT/moe_fp8_tables"
  cp "$(python3 -c 'from pagoda.kernels import moe; print(moe.CONFIG_DIR)')"/*dtype=float8_e4m3fn* \
    "$OUT/moe_fp8_tables/" 2>/dev/null
  for v in table 0; do
    echo "== FP8 experts against bf16, PAGODA_MOE_ACT_FP8=$v"
    PAGODA_MOE_ACT_FP8=$v timeout 120 python3 -m pagoda.bench.moe_fp8_sweep --tokens 128,256,1024,8192 \
      --out "$OUT/moe_act_fp8_$v.json" 2>&1 | moe_sweep_rows
  done
fi
if has split-k-ab; then
  echo "== llama3-8b fp8 decode step: split-K sums in kernels of their own / in the norms / also in qkv prep"
  timeout 300 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,2,8,32,64 \
    --context 512 --rounds 3 sum_kernels=PAGODA_FUSE_SPLIT_K=0 norms=PAGODA_FUSE_SPLIT_K=norms \
    all=PAGODA_FUSE_SPLIT_K=1 2>&1 | tail -8
fi
if has figures; then
  # issue 20 / 25 figures on the committed tree, no tuning (each run in a fresh process; a cold machine compiles
  # llama3-8b FP8's kernels in the first run, hence its longer limit): FP8 batch-1, then the sweep's one-row GEMVs
  echo "== llama3-8b fp8 batch-1 after 512 tokens"
  timeout 200 python3 -m pagoda.bench throughput --model llama3-8b --load-format dummy --quantization fp8 \
    --num-prompts 8 --input-len 512 --input-len-jitter 0 --output-len 16 --latency-prompt-len 512 --timeout 190 \
    --out "$OUT/figures_llama3-8b_fp8_b1.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -2
  qwen3_kv_pair figures
  trtllm_1000 figures
  echo "== deepseek-v2-lite reference + batch-1"
  timeout 160 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
    --latency-prompt-len 512 --timeout 150 --out "$OUT/figures_deepseek-v2-lite.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -5
fi
if has attention; then
  # the decode launches of the twenty-second session (fp8: softmax sums per key slot, also for the decode rows of
  # steps with chunks) against the ones before, over B = 1, 64, 256 and contexts to 4096 (ATTENTION_KV_ARGS,
  # ATTENTION_KV_ONLY); then the runs they move: qwen3-0.6b reference with a bf16 and an fp8 cache, llama3-8b bf16
  # reference, trtllm-1000
  timeout 200 python3 -m pagoda.bench.kv_fp8_bench ${ATTENTION_KV_ARGS:---long} \
    --only "${ATTENTION_KV_ONLY:-bf16_w4_t64,fp8_s22_qk2_eager,fp8_default}" \
    --out "$OUT/kv_fp8_long.json" 2>&1 | grep -v "accuracy\|normal q" | tail -${ATTENTION_KV_TAIL:-40}
  qwen3_kv_pair attention
  echo "== llama3-8b bf16 reference"
  timeout 100 python3 -m pagoda.bench throughput --model llama3-8b "${WORKLOAD[@]}" --timeout 90 \
    --out "$OUT/attention_llama3-8b.json" 2>&1 | grep -v "^[a-z-]*: {" | tail -3
  trtllm_1000 attention
fi
if has gluon; then
  # the figures the Gluon fp8 decode kernel moves (twenty-fourth session): qwen3-0.6b reference with a bf16 and an fp8
  # cache, trtllm-1000, llama3-8b FP8 + FP8 KV reference and OpenAI-sampled
  qwen3_kv_pair gluon
  trtllm_1000 gluon
  llama_fp8_runs gluon_llama_fp8 "reference fp8" "openai fp8"
fi
if has one-loop; then
  # every decode tile in one masked loop (decode_one_loop) against the two loops and bf16, then qwen3-0.6b reference
  # with a bf16 and an fp8 cache on the tree as carried
  timeout 240 python3 -m pagoda.bench.kv_fp8_bench --long \
    --only "${ONE_LOOP_ONLY:-fp8_s23_one_loop,bf16_s23_one_loop,fp8_default}" \
    --out "$OUT/kv_fp8_one_loop.json" 2>&1 | grep -v "accuracy\|normal q" | tail -${ONE_LOOP_TAIL:-24}
  qwen3_kv_pair one_loop
fi
if has mla-lazy; then
  # the MLA decode launch with its softmax sums per key slot against without (16 and 128 heads, B = 64 / 256, 1k /
  # 4k, bf16 / fp8), then deepseek-v2-lite's reference workload and batch-1 on the committed default
  timeout 240 python3 -m pagoda.bench.mla_bench --parts lazy --out "$OUT/mla_lazy.json" 2>&1 | grep "^decode" \
    | tail -32
  echo "== deepseek-v2-lite reference + batch-1"
  timeout 160 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy --workload reference \
    --latency-prompt-len 512 --timeout 150 --out "$OUT/mla_lazy_deepseek-v2-lite.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -5
fi
if has llama-fp8; then
  # llama3-8b FP8 on the committed tree: the decode step at B = 1, 2, 4 with SiLU fused into the down GEMV at one
  # row (the default) against never (PAGODA_FUSE_SILU_GEMV=0), B=1's kernels by name; then the reference workload
  # with FP8 weights, with FP8 weights + FP8 KV, and the latter under OpenAI-style sampling (T 0.7, top_p 0.95)
  echo "== llama3-8b fp8 decode step, SiLU in the down GEMV at one row (default) / never"
  timeout 240 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,2,4 --context 512 \
    --profile default=PAGODA_FUSE_SILU_GEMV= silu_off=PAGODA_FUSE_SILU_GEMV=0 2>&1 | tail -44
  llama_fp8_runs llama_fp8 "reference auto" "reference fp8" "openai fp8"
fi
if has deepseek-profile; then
  timeout 200 python3 -m pagoda.bench.deepseek_bench --model deepseek-v2-lite --quantization none \
    --batches "${DEEPSEEK_PROFILE_BATCHES:-1}" --profile --out "$OUT/deepseek_v2_lite_profile.json" 2>&1 \
    | grep -v "^{" | tail -80
fi
if has kv-fp8; then
  timeout 300 python3 -m pagoda.bench.kv_fp8_bench ${KV_FP8_ARGS:-} --out "$OUT/kv_fp8_bench.json" \
    --only "${KV_FP8_ONLY:-fp8_pinned_t64,fp8_pinned_t128,fp8_pinned_t64_kom,fp8_words_t64,fp8_staged_t32_r128,fp8_default}" \
    2>&1 | tail -${KV_FP8_TAIL:-24}
fi
if has candidates; then
  # the decode launch of an fp8 cache with 2 / 8 warps and 32-key tiles (prepared in the seventeenth session, untimed),
  # and QK^T on fp8 tensor cores with q as one e4m3 term (qk_fp8, an accuracy trade) or two (qk_fp8x2, eighteenth)
  timeout 240 python3 -m pagoda.bench.kv_fp8_bench --quick --only fp8_hf,fp8_words_t64,fp8_qk_t64,fp8_qk2,fp8_default \
    --out "$OUT/kv_fp8_candidates.json" 2>&1 | tail -14
  # the same in whole decode steps over an fp8 cache (PAGODA_FP8_KV_DECODE): llama3-8b FP8 and qwen3-0.6b
  timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --kv-cache-dtype fp8 \
    --batches 64,256 --context 1024 words=PAGODA_FP8_KV_DECODE= qk2=PAGODA_FP8_KV_DECODE=qk_fp8x2 \
    qk=PAGODA_FP8_KV_DECODE=qk_fp8 2>&1 | grep "B=" | tail -2
  timeout 120 python3 -m pagoda.bench.step_ab --model qwen3-0.6b --kv-cache-dtype fp8 --batches 256 --context 640 \
    words=PAGODA_FP8_KV_DECODE= qk2=PAGODA_FP8_KV_DECODE=qk_fp8x2 2>&1 | grep "B=" | tail -1
  # SiLU-and-mul inside the weight-only down projection (one launch fewer a layer), llama3-8b FP8 at 1-8 tokens
  timeout 200 python3 -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,4,8 \
    off=PAGODA_FUSE_SILU_GEMV=0 on=PAGODA_FUSE_SILU_GEMV=1 2>&1 | grep "B=" | tail -3
fi
if has act-fp8; then
  # W8A8 inside the GEMV kernel (act_fp8 tiles: the activation tile quantized where it is loaded, fp8 tensor cores)
  # tuned against the committed entries at 1-256 rows, the sweep with that table, then llama3-8b FP8 end to end
  timeout 400 python3 -m pagoda.bench.fp8_tune --act-fp8-only --out "$OUT/tune_act" 2>&1 \
    | grep -E "^tune|tuned|slower|^sweep .*M= *(1|2|4|8|16|32|64|128|256):" | cut -c1-230
  cp "$OUT"/tune_act/w8a16,*.json /tmp/site/pagoda/kernels/fp8_configs/ && echo "act_fp8 table installed"
  echo "== llama3-8b fp8 (reference workload, batch-1 after 512 tokens)"
  timeout 170 python3 -m pagoda.bench throughput --model llama3-8b "${WORKLOAD[@]}" --quantization fp8 \
    --latency-prompt-len 512 --timeout 140 --out "$OUT/act_fp8_llama3-8b_fp8.json" 2>&1 | grep -v "^[a-z-]*: {" \
    | tail -4
fi
if has moe-sum; then
  # the sparse layers' top-k sum left to the next residual add + norm (PAGODA_FUSE_MOE_SUM, eighteenth session):
  # decode steps A/B, then deepseek-v2-lite's reference workload with it on (issue 20's 0.7 of the floor)
  timeout 200 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 64,256 --context 640 \
    off=PAGODA_FUSE_MOE_SUM=0 on=PAGODA_FUSE_MOE_SUM=1 2>&1 | grep "B=" | tail -2
  timeout 150 python3 -m pagoda.bench.step_ab --model qwen3-30b-a3b --batches 256 --context 640 \
    off=PAGODA_FUSE_MOE_SUM=0 on=PAGODA_FUSE_MOE_SUM=1 2>&1 | grep "B=" | tail -1
  PAGODA_FUSE_MOE_SUM=1 timeout 240 python3 -m pagoda.bench throughput --model deepseek-v2-lite --load-format dummy \
    --workload reference --timeout 200 --out "$OUT/moe_sum_deepseek-v2-lite_reference.json" 2>&1 \
    | grep -v "^[a-z-]*: {" | tail -4
fi
if has moe-fp8; then
  timeout 400 python3 -m pagoda.bench.moe_fp8_sweep --out "$OUT/moe_fp8_sweep.json" 2>&1 | moe_sweep_rows
fi
if has dense-gemv; then
  # the 16-bit GEMV tuned per layer and M bucket against cuBLAS, the table installed, then decode steps with it
  timeout 480 python3 -m pagoda.bench.gemv_tune --models "${DENSE_MODELS:-llama3-8b,qwen3-0.6b,deepseek-v2-lite}" \
    --buckets "${DENSE_BUCKETS:-1}" --out "$OUT/gemv_tune" 2>&1 | grep -E "^tune|tuned" | cut -c1-220
  mkdir -p /tmp/site/pagoda/kernels/gemv_configs
  table=$(python3 -c "import torch; from pagoda.kernels import gemv
print(gemv.config_name(torch.cuda.get_device_name().replace(' ', '_')))")
  cp "$OUT"/gemv_tune/dense_table.json "/tmp/site/pagoda/kernels/gemv_configs/$table" && echo "installed $table"
  for shape in ${DENSE_MODELS_AB:-llama3-8b qwen3-0.6b deepseek-v2-lite}; do
    timeout 200 python3 -m pagoda.bench.step_ab --model $shape --batches "${DENSE_BATCHES:-1,4}" \
      off=PAGODA_DENSE_GEMV=0 tuned=PAGODA_DENSE_GEMV= on=PAGODA_DENSE_GEMV=1 2>&1 | grep "B=" | tail -4
  done
fi
if has structured; then
  # the grammar process (on: the default on CUDA) against the worker's mask thread (off), then the host's round trip
  for mode in on off; do
    timeout 300 python3 -m pagoda.bench.structured --model qwen3-0.6b --load-format dummy \
      --tokenizer "${TOKENIZER:-.gpu/smollm2-tok}" --num-requests 256 --max-tokens 256 --prompt-len 64 --rounds 6 \
      --constrained-every 1 4 --grammar-process "$mode" \
      --out "$OUT/structured$([ "$mode" = on ] || echo _thread).json" 2>&1 | grep -v INFO | tail -12
  done
  timeout 200 python3 -m pagoda.bench.grammar_step --tokenizer "${TOKENIZER:-.gpu/smollm2-tok}" --rows 64 256 \
    --steps 40 2>&1 | tail -12
  # a grammar's forced start prefilled or sampled step by step: batch-1 latency and requests/s at 64
  timeout 200 python3 -m pagoda.bench.fast_forward --model qwen3-0.6b --load-format dummy \
    --tokenizer "${TOKENIZER:-.gpu/smollm2-tok}" --batch 64 --out "$OUT/fast_forward.json" 2>&1 | tail -1
fi
