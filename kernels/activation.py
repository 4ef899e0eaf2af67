"""Triton fused SiLU-and-multiply for the gated MLP: [T, 2I] -> silu(gate) * up [T, I]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl


@triton.jit  # inter_size stays specialised (fixed per model): its divisibility lets the `up` loads vectorise
def _silu_and_mul_kernel(x_ptr, out_ptr, inter_size, stride_xt, stride_ot, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (tokens, column blocks): gate is x[t, :I], up is x[t, I:]."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter_size
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the storage dtype before the product, as F.silu(gate) * up rounds in PyTorch
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = silu * up
    tl.store(out_ptr + token * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]; reference.silu_and_mul. Rows of x may be strided."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * I], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not a float type")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)  # [T, I]
    if (out.shape != (num_tokens, inter_size) or out.dtype != x.dtype or out.device != x.device
            or out.stride(1) != 1):
        raise ValueError(f"out must be [{num_tokens}, {inter_size}] {x.dtype} on {x.device}, contiguous along its "
                         f"last dim, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if num_tokens == 0 or inter_size == 0:
        return out
    block = min(block, max(16, triton.next_power_of_2(inter_size)))
    pdl_options = pdl.launch_options(x.device)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, block))](
        x, out, inter_size, x.stride(0), out.stride(0), BLOCK=block, num_warps=4 if block <= 1024 else 8,
        **pdl_options)
    return out
