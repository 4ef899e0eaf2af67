"""Linear layers with 16-bit weights at a few rows (decode at small batch) on the weight-only FP8 kernel's code path
(kernels/fp8_weight_only.py, no scales): a Triton GEMV that launches under programmatic dependent launch like the
rest of a decode step's chain, where cuBLAS's GEMV breaks it (kernels/pdl.py). Semantics: torch.nn.functional.linear
with fp32 accumulation.

Opt-in, and measured slower than cuBLAS (H200, 2026-12-03, bench/step_ab.py, graph-timed decode step at 512 cached
tokens with default tiles: llama3-8b bf16 4.53 -> 5.20 ms at B=1 and 4.76 -> 22.76 ms at B=4; deepseek-v2-lite
2.56 -> 2.58 ms at B=1, 4.38 -> 5.60 ms at B=4): these tiles were never tuned for 16-bit weights, and the B=4
FMA tiles (one program reducing every row) are far off. PAGODA_DENSE_GEMV=1 routes the bf16/fp16 linear layers of steps of at most MAX_ROWS tokens
here (models/base.py `quantized_linear`) and lets single-token steps of dense models launch with PDL
(CausalLM.pdl_mode). Tiles: fp8_weight_only.default_tiles (no tuned table for 16-bit weights yet).
"""

from __future__ import annotations

import os

import torch

from pagoda.kernels.fp8_weight_only import GemvTiles, _launch_split_k_sum, default_tiles, gemv_rows, launch_gemv

MAX_ROWS = 8
DTYPES = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """PAGODA_DENSE_GEMV=1 (measurements only: slower than cuBLAS as tiled today, module docstring)."""
    return os.environ.get("PAGODA_DENSE_GEMV") == "1"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_gemv serves x [..., K] @ weight^T: enabled, at most MAX_ROWS rows, a 2-D 16-bit weight of x's
    dtype, contiguous along K."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (enabled() and 1 <= rows <= MAX_ROWS and weight.dim() == 2 and weight.dtype in DTYPES
            and x.dtype == weight.dtype and weight.stride(1) == 1)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tiles: GemvTiles | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias) for a bf16/fp16 W [N, K] contiguous along K and x of its dtype,
    fp32 accumulation, at most MAX_ROWS rows unless tiles are given. tiles: override."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.stride(1) != 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be bf16/fp16 [N, K={x.shape[-1]}] contiguous along K, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x must have the weight's dtype {weight.dtype}, got {x.dtype}")
    n, k = weight.shape
    x2 = gemv_rows(x, n, bias, MAX_ROWS if tiles is None else None, "dense_gemv")  # [M, K]
    num_rows = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if num_rows == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    tiles = tiles or default_tiles(num_rows, n, k)
    out, part = launch_gemv(x2, weight, None, None, bias, tiles)
    if tiles.split_k > 1:
        _launch_split_k_sum(part, out, bias)
    return out.view(out_shape)
