"""sm_90 SASS of the W8A16 kernel's K loop, swap_ab or not, for llama3-8b's o projection at 64 rows (CPU only), as
run in the seventeenth session; the helpers now live in pagoda.bench.gemv_sass.
TRITON_INTERPRET=0 PYTHONPATH=. python bench/results/s17/gemv_sass.py"""
from pagoda.bench import gemv_sass
from pagoda.kernels import fp8_weight_only as w8

gemv_sass.use_compile_only_driver()
variants = [w8.GemvTiles(block_m=64, block_n=64, block_k=128, split_k=4, use_dot=True, num_stages=3)]
for bm, bn, bk, warps in ((64, 64, 128, 4), (64, 128, 128, 4), (64, 128, 128, 8), (64, 128, 256, 8),
                          (64, 256, 128, 8), (16, 128, 256, 8), (16, 256, 128, 8), (128, 128, 128, 8)):
    variants.append(w8.GemvTiles(block_m=bm, block_n=bn, block_k=bk, split_k=4, use_dot=True, num_stages=3,
                                 swap_ab=True, num_warps=warps))
for tiles in variants:
    print(gemv_sass.loop_row(64, tiles, gemv_sass.compile_w8a16(64, 4096, 4096, tiles)))
