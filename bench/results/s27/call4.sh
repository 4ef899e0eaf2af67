# call 4: MLA's absorbed projections: head_gemv tiles at one row, a tensor-core kernel against cuBLAS's bmm at 64 /
# 256 rows; v2-lite's B=1 step with the 16-bit GEMV (tuned table of call 2) with and without head_gemv.
set -u
echo "## head_gemv (T=1)"; timeout 150 python3 bench/results/s27/head_gemv.py 2>&1 | tail -4
echo "## head_bmm"; timeout 200 python3 bench/results/s27/head_bmm.py 2>&1 | grep -v "^skip" | tail -6
echo "## step_ab"
timeout 200 python3 -m pagoda.bench.step_ab --model deepseek-v2-lite --batches 1 off=PAGODA_DENSE_GEMV=0 \
  on=PAGODA_DENSE_GEMV=1 "linears=PAGODA_DENSE_GEMV=1;PAGODA_HEAD_GEMV=0" 2>&1 | grep "B=" | tail -3
