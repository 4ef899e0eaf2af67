"""Compile every grouped-GEMM candidate of `moe_tune --weights fp8` for sm_90 on a machine with no GPU (Triton's own
ptxas, tests/gpu_compile.py's compile-only driver): weight-only and W8A8 (act_fp8) tiles at deepseek-v2-lite's
expert dims (per-row scales) and DeepSeek-V3's (128-wide scale blocks), both GEMMs, and report each tile's shared
memory (an H200 / H100 block may use 232,448 bytes), registers and spills, so the tuner's candidates that cannot
run are known before device time is spent on them.

    cd tests && TRITON_INTERPRET=0 CUDA_VISIBLE_DEVICES= python ../bench/results/s35/act_fp8_candidates.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import gpu_compile  # noqa: E402
import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pagoda.bench import moe_tune  # noqa: E402
from pagoda.kernels import moe  # noqa: E402

SHARED_LIMIT = 232_448
SHAPES = (("deepseek-v2-lite", (66, 8, 1408, 2048), None), ("deepseek-v3", (257, 9, 2048, 7168), 128))
COMPILED: list[Any] = []


def main() -> int:
    run = JITFunction.run

    def keep(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        COMPILED.append(kernel)
        return kernel
    JITFunction.run = keep  # type: ignore[method-assign]
    gpu_compile.install()  # compile-only launches through keep
    rows = []
    for name, (experts, top_k, inter, hidden), group_k in SHAPES:
        tokens = 1024
        ids = torch.zeros(tokens, top_k, dtype=torch.int32)  # [T, k]
        for which, (n, k, fuse) in (("gate_up", (2 * inter, hidden, True)), ("down", (hidden, inter, False))):
            w = torch.empty(2, n, k, dtype=torch.float8_e4m3fn)
            scale = torch.empty(2, n, k // (group_k or k))
            a = torch.empty(tokens if fuse else tokens * top_k, k, dtype=torch.bfloat16)
            out = torch.empty(tokens * top_k, n // 2 if fuse else n, dtype=torch.bfloat16)
            align = moe.align_pairs(ids, experts, 16)
            for tile in moe_tune.gemm_candidates(True, group_k, k):
                align = moe.align_pairs(ids, experts, tile.block_m)
                COMPILED.clear()
                gpu_compile.RESULTS.clear()
                moe._moe_gemm(a, w, scale, group_k or k, align, out, tokens * top_k, top_k if fuse else 1, fuse,
                              None if fuse else torch.ones(tokens * top_k), tile, tile.act_fp8)
                failed = [v for v in gpu_compile.RESULTS.values() if v.startswith("FAIL")]
                kernel = COMPILED[-1] if COMPILED and not failed else None
                meta = kernel.metadata if kernel is not None else None
                shared = getattr(meta, "shared", None)
                regs = getattr(kernel, "n_regs", None)
                rows.append((name, which, tile, shared, regs, failed[0][:80] if failed else ""))
                fits = "" if shared is None or shared <= SHARED_LIMIT else "  OVER"
                print(f"{name:17s} {which:7s} {'w8a8' if tile.act_fp8 else 'w8a16'} "
                      f"{tile.block_m:>3}x{tile.block_n:<3}x{tile.block_k:<3} g{tile.group_m} w{tile.num_warps} "
                      f"s{tile.num_stages}  shared {shared}{fits} {failed[0][:100] if failed else ''}", flush=True)
    over = [r for r in rows if r[3] is not None and r[3] > SHARED_LIMIT]
    failed = [r for r in rows if r[5]]
    print(f"{len(rows)} compiled; {len(failed)} failed to compile; {len(over)} over {SHARED_LIMIT} B of shared memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
