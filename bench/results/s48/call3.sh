#!/usr/bin/env bash
# Session 48, call 3, any card: the two sampler kernel changes on CUDA (6227727: _nucleus_decide reads a round's
# per-split slots only for rows still undecided; 865b473: _gumbel_argmax_kernel writes an empty split for rows
# drawn elsewhere): the sampler's GPU tests, and "mixed" and "openai" steps by kernel, prev (7f90ec2, .snap/prev.tgz) /
# head, twice each.
OUT=${OUT:-/tmp/out}
start=$(date +%s)
BUDGET=${BUDGET:-560}  # seconds this call may run
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
PHASES=none bash bench/gpu_check.sh >/dev/null 2>&1
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== sampler GPU tests [$(( $(date +%s) - start )) s]"
PYTHONPATH=/tmp/site:/tmp/tests-path timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m pytest -q \
  -p no:cacheprovider -o pythonpath= -rf --tb=short -m "gpu or not gpu" tests/test_sampler_kernel_path.py \
  "tests/test_sampler.py::test_kernels_match_reference_gpu" "tests/test_sampler.py::test_gpu_sample_matches_cpu_sample" \
  2>&1 | tail -4
rm -rf /tmp/prev && mkdir -p /tmp/prev && tar xzf .snap/prev.tgz -C /tmp/prev
(cd /tmp/prev && python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site-prev . \
  >/dev/null 2>&1)
for dep in /tmp/site/*; do [[ $(basename "$dep") == pagoda* ]] || ln -sfn "$dep" /tmp/site-prev/ 2>/dev/null; done
for tree in prev head prev head; do
  site=/tmp/site; [[ $tree == prev ]] && site=/tmp/site-prev
  (( $(left) < 40 )) && break
  echo "== $tree: openai step by kernel [$(( $(date +%s) - start )) s]"
  PYTHONPATH=$site timeout 60 python3 -m pagoda.bench.sampler_bench --settings mixed openai --vocab 151936 --iters 100 \
    --profile 2>&1 | grep -E "^ *[0-9]|^--" | head -30
done
echo "== done [$(( $(date +%s) - start )) s]"
