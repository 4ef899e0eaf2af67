"""sm_90 SASS of the W8A16 kernel's K loop against its act_fp8 tiles (the activation tile quantized in registers,
e4m3 x e4m3 on the tensor cores) at llama3-8b's o projection, 64 and 128 rows (CPU only, no GPU needed).
TRITON_INTERPRET=0 PYTHONPATH=. python bench/results/s18/act_fp8_sass.py"""
import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import gpu_compile  # noqa: E402

from pagoda.bench import attention_sass as sass_tools  # noqa: E402
from pagoda.kernels import fp8_weight_only as w8  # noqa: E402

gpu_compile.driver.set_active(gpu_compile.CompileOnlyDriver())


def compile_tiles(m: int, n: int, k: int, t: w8.GemvTiles):  # noqa: ANN201 (Triton's compiled kernel)
    x = torch.empty(m, k, dtype=torch.bfloat16)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(n, 1, dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    part = torch.empty(t.split_k, m, n, dtype=torch.float32)
    return w8._w8a16_kernel.warmup(
        x, w, s, out, part, out, m, n, k, x.stride(0), w.stride(0), s.stride(0), out.stride(0),
        part.stride(0) if t.split_k > 1 else 0, GROUP_K=0, SPLIT_K=t.split_k, HAS_BIAS=False, USE_DOT=t.use_dot,
        EVEN_K=True, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, FP32_DOT=False, LATE_REDUCE=False,
        HAS_SCALE=True, SWAP_AB=t.swap_ab, DOT_PRECISION="tf32", GATED=False, ACT_FP8=t.act_fp8, HW_CAST=True,
        USE_PDL=0, num_warps=t.num_warps, num_stages=t.num_stages, grid=(1,))


def main() -> None:
    n, k = 4096, 4096
    print("| M | act_fp8 | swap | warps | BM | BN | BK | regs | shared KB | loop instrs (warp) | per KB weight | "
          "MMA | spills | top |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in (64, 128):
        for act, swap, (bm, bn, bk, warps) in (
                (False, True, (64, 128, 128, 8)), (True, True, (64, 128, 128, 8)), (True, True, (64, 64, 128, 4)),
                (True, True, (128, 128, 128, 8)), (False, False, (64, 64, 128, 4)), (True, False, (64, 64, 128, 4)),
                (True, False, (128, 64, 128, 8)), (True, False, (64, 128, 128, 4))):
            if bm > m:
                continue
            t = w8.GemvTiles(block_m=bm, block_n=bn, block_k=bk, split_k=4, use_dot=True, num_warps=warps,
                             num_stages=3, swap_ab=swap, act_fp8=act)
            kern = compile_tiles(m, n, k, t)
            sass, usage = sass_tools.disassemble(kern.asm["cubin"])
            regs = int(re.search(r"REG:(\d+)", usage).group(1))
            loops = [b for b in sass_tools.loop_bodies(sass) if len(b) > 30]
            body = max(loops, key=len) if loops else []
            per_kb = len(body) * t.num_warps / (bn * bk / 1024)
            mma = collections.Counter(op for op in body if "GMMA" in op or op.startswith("HMMA"))
            spills = sum(op in ("LDL", "STL") for op in body)
            top = ", ".join(f"{op} {c}" for op, c in collections.Counter(body).most_common(5))
            print(f"| {m} | {act} | {swap} | {warps} | {bm} | {bn} | {bk} | {regs} | {kern.metadata.shared / 1024:.0f}"
                  f" | {len(body)} | {per_kb:.0f} | {dict(mma)} | {spills} | {top} |", flush=True)


main()
