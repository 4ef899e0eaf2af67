"""What the FP8 GEMV kernel (kernels/fp8_weight_only._w8a16_kernel) costs per K step on an H100/H200, read from its
sm_90 SASS on a machine with no GPU (tests/gpu_compile.py's compile-only driver, Triton's bundled ptxas and
nvdisasm, as bench/attention_sass.py does for attention): registers, shared memory, the instructions of the K loop
per warp and per KB of weights a program reads, the MMA instructions (HGMMA: 16-bit operands, QGMMA: e4m3), spills,
and the instruction kinds that dominate. Tile sets: W8A16 (the weight tile converted to bf16) against act_fp8
(the activation tile quantized, both operands e4m3), swap_ab or not.

    TRITON_INTERPRET=0 python -m pagoda.bench.gemv_sass [--rows 1,16,64,128] [--n 4096] [--k 4096]
    TRITON_INTERPRET=0 python -m pagoda.bench.gemv_sass --committed-one-row   # tests/test_gemv_sass.py's check
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from pagoda.bench import attention_sass as sass_tools
from pagoda.kernels import fp8_weight_only as w8

# (act_fp8, swap_ab, block_m, block_n, block_k, warps); split-K 4, 3 stages. A row count takes the variants whose
# block_m is max(16, rows) up to 32 rows, else those of 64 and 128 rows that it fills.
VARIANTS = ((False, False, 16, 64, 128, 4), (True, False, 16, 64, 128, 4), (False, True, 16, 128, 128, 4),
            (True, True, 16, 128, 128, 4), (False, True, 16, 256, 128, 8), (True, True, 16, 256, 128, 8),
            (False, True, 64, 128, 128, 8), (True, True, 64, 128, 128, 8), (True, True, 64, 64, 128, 4),
            (True, True, 128, 128, 128, 8), (False, False, 64, 64, 128, 4), (True, False, 64, 64, 128, 4),
            (True, False, 128, 64, 128, 8), (True, False, 64, 128, 128, 4))


# one row: the committed table's FMA tiles for llama3-8b (o: 16 x 512, split 4; qkv: 8 x 1024) and late_reduce
FMA_TILES = (w8.GemvTiles(block_m=1, block_n=16, block_k=512, split_k=4),
             w8.GemvTiles(block_m=1, block_n=8, block_k=1024, split_k=1),
             w8.GemvTiles(block_m=1, block_n=16, block_k=512, split_k=4, late_reduce=True))


def variants_for(num_rows: int) -> list[tuple[bool, bool, int, int, int, int]]:
    if num_rows <= 32:
        return [v for v in VARIANTS if v[2] == max(16, num_rows)]
    return [v for v in VARIANTS if v[2] in (64, 128) and v[2] <= num_rows]


def use_compile_only_driver() -> None:
    """Compile for sm_90 with no GPU: tests/gpu_compile.py's driver (a checkout's tests folder)."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling for the GPU needs TRITON_INTERPRET unset or 0"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import gpu_compile

    gpu_compile.driver.set_active(gpu_compile.CompileOnlyDriver())


def compile_w8a16(num_rows: int, n: int, k: int, tiles: w8.GemvTiles, gated: bool = False) -> Any:
    """The compiled _w8a16_kernel (Triton's CompiledKernel) for x [M, K] bf16, e4m3 W [N, K], per-channel scales."""
    x = torch.empty(num_rows, (2 if gated else 1) * k, dtype=torch.bfloat16)
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(n, 1, dtype=torch.float32)
    out = torch.empty(num_rows, n, dtype=torch.bfloat16)
    part = torch.empty(tiles.split_k, num_rows, n, dtype=torch.float32)
    return w8._w8a16_kernel.warmup(
        x, weight, scale, out, part, out, num_rows, n, k, x.stride(0), weight.stride(0), scale.stride(0),
        out.stride(0), part.stride(0) if tiles.split_k > 1 else 0, GROUP_K=0, SPLIT_K=tiles.split_k,
        HAS_BIAS=False, USE_DOT=tiles.use_dot, EVEN_K=k % (tiles.split_k * tiles.block_k) == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, FP32_DOT=False,
        LATE_REDUCE=tiles.late_reduce, HAS_SCALE=True, SWAP_AB=tiles.swap_ab, DOT_PRECISION="tf32", GATED=gated,
        ACT_FP8=tiles.act_fp8, HW_CAST=True, USE_PDL=0, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        grid=(1,))


def loop_row(num_rows: int, tiles: w8.GemvTiles, kernel: Any) -> str:
    """One table row: the longest loop of the kernel's SASS (the K loop)."""
    sass, usage = sass_tools.disassemble(kernel.asm["cubin"])
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    loops = [body for body in sass_tools.loop_bodies(sass) if len(body) > 30]
    body = max(loops, key=len) if loops else []
    per_kb = len(body) * tiles.num_warps / (tiles.block_n * tiles.block_k / 1024)
    mma = collections.Counter(op for op in body if "GMMA" in op or op.startswith("HMMA"))
    spills = sum(op in ("LDL", "STL") for op in body)
    top = ", ".join(f"{op} {count}" for op, count in collections.Counter(body).most_common(5))
    split = f"{tiles.split_k}{' late' if tiles.late_reduce else ''}"
    return (f"| {num_rows} | {tiles.act_fp8} | {tiles.swap_ab} | {tiles.num_warps} | {tiles.block_m} | {tiles.block_n}"
            f" | {tiles.block_k} | {split} | {registers} | {kernel.metadata.shared / 1024:.0f} | {len(body)}"
            f" | {per_kb:.0f} | {dict(mma)} | {spills} | {top} |")


def committed_one_row_loops(device_name: str = "NVIDIA H200") -> list[dict[str, Any]]:
    """The K loop of every one-row FMA tile in the committed W8A16 table (and the gated down projection on its
    tile): shape, instructions a warp runs per K step, and the cross-lane shuffles among them. A one-row tile
    should reduce across lanes once per output column block, not per element: 16974a8 moved the x load after w and
    Triton's layout then reduced at every K step (llama3-8b o: 433 instructions, 82 SHFL, against 261 and 20),
    which took FP8 batch-1 decode from 2.78 to 4.13 ms/token on the H200."""
    rows = []
    for (n, k, bucket), tiles in sorted(w8.tuned_table(device_name).items()):
        if bucket != 1 or not isinstance(tiles, w8.GemvTiles) or tiles.use_dot:
            continue
        for gated in (False, True) if k > n else (False,):  # the down projection also runs gated at one row
            sass, _ = sass_tools.disassemble(compile_w8a16(1, n, k, tiles, gated).asm["cubin"])
            loops = [body for body in sass_tools.loop_bodies(sass) if len(body) > 30]
            body = max(loops, key=len) if loops else []
            rows.append({"n": n, "k": k, "gated": gated, "block_n": tiles.block_n, "block_k": tiles.block_k,
                         "loop": len(body), "shfl": sum(op == "SHFL" for op in body)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,128", help="comma-separated token counts")
    parser.add_argument("--n", type=int, default=4096, help="output channels (llama3-8b's o: 4096)")
    parser.add_argument("--k", type=int, default=4096, help="input channels")
    parser.add_argument("--committed-one-row", action="store_true",
                        help="print the committed table's one-row FMA tiles' K loops as JSON lines, then stop")
    args = parser.parse_args(argv)
    use_compile_only_driver()
    if args.committed_one_row:
        for row in committed_one_row_loops():
            print(json.dumps(row), flush=True)
        return 0
    print("| M | act_fp8 | swap | warps | BM | BN | BK | split | regs | shared KB | loop instrs (warp) | "
          "per KB weight | MMA | spills | top |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for num_rows in (int(rows) for rows in args.rows.split(",")):
        for tiles in FMA_TILES if num_rows == 1 else ():
            print(loop_row(num_rows, tiles, compile_w8a16(num_rows, args.n, args.k, tiles)), flush=True)
        for act, swap, block_m, block_n, block_k, warps in variants_for(num_rows):
            tiles = w8.GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=4, use_dot=True,
                                 num_warps=warps, num_stages=3, swap_ab=swap, act_fp8=act)
            print(loop_row(num_rows, tiles, compile_w8a16(num_rows, args.n, args.k, tiles)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
