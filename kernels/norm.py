"""Triton RMSNorm and fused residual-add + RMSNorm, one pass over each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl

_MAX_HIDDEN = 32768  # one row lives in registers; beyond this it would spill


@triton.jit(do_not_specialize=["num_rows", "inner_rows"])  # they change every step: no recompiles
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     num_rows, inner_rows, num_cols, eps,
                     stride_x0, stride_x1, stride_r0, stride_r1, stride_o0, stride_o1, stride_ro0, stride_ro1,
                     stride_xs, HAS_RESIDUAL: tl.constexpr, X_PARTS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_R rows per program (several short rows, e.g. per-head q/k norm, share one program). A row r is
    x[r // inner_rows, r % inner_rows, :], so [T, heads, D] views of a fused qkv need no copy. X_PARTS > 0: x is
    a split-K GEMM's fp32 partial sums or an MoE layer's top-k outputs [X_PARTS, T, N] (stride_xs apart), summed
    in fp32 in order and rounded to the output dtype as the GEMM's own sum would round them."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    i0 = (rows // inner_rows).to(tl.int64)
    i1 = (rows % inner_rows).to(tl.int64)
    col_mask = cols < num_cols
    mask = (rows < num_rows)[:, None] & col_mask[None, :]  # [BLOCK_R, BLOCK_N]
    x_ptrs = x_ptr + (i0 * stride_x0 + i1 * stride_x1)[:, None] + cols[None, :]
    if X_PARTS == 0:
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
        for part in tl.static_range(X_PARTS):
            x += tl.load(x_ptrs + part * stride_xs, mask=mask, other=0.0)
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + (i0 * stride_r0 + i1 * stride_r1)[:, None] + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        # The reference adds in the input dtype; one fp32 add then one rounding gives the same bits.
        summed = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + (i0 * stride_ro0 + i1 * stride_ro1)[:, None] + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / num_cols + eps)  # [BLOCK_R]
    # Round the normalised row to the input dtype before the weight, as Hugging Face (and the reference) does.
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    tl.store(out_ptr + (i0 * stride_o0 + i1 * stride_o1)[:, None] + cols[None, :],
             (normed * weight[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(stride of dim 0, stride of dim 1) of a [R, N] or [R0, R1, N] tensor; [R, N] has no inner dim."""
    return (t.stride(0), 0) if t.dim() == 2 else (t.stride(0), t.stride(1))


def _check(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim")


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor,
            residual_out: torch.Tensor | None, x_parts: torch.Tensor | None = None) -> None:
    """Checks (messages built only on failure: this runs several times a layer), then one launch. x_parts: fp32
    partial sums [S, *x.shape] whose rounded sum is x (x itself is then only a shape and dtype)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, N] or [T, heads, N], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not a float type")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous along its last dim")
    num_cols = x.shape[-1]
    if not 0 < num_cols <= _MAX_HIDDEN:
        raise ValueError(f"the normalised dim must be in 1..{_MAX_HIDDEN}, got {num_cols}")
    if (weight.shape != (num_cols,) or weight.dtype != x.dtype or not weight.is_contiguous()
            or weight.device != x.device):
        raise ValueError(f"weight must be [{num_cols}] {x.dtype} contiguous on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    _check("out", out, x)
    if residual is not None and residual_out is not None:
        _check("residual", residual, x)
        _check("residual_out", residual_out, x)
    num_rows = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
    if num_rows == 0:
        return
    block_n = triton.next_power_of_2(num_cols)
    block_r = max(1, min(64, 2048 // block_n))  # short rows: pack ~2k elements per program
    num_warps = 4 if block_r * block_n <= 4096 else (8 if block_n <= 8192 else 16)
    inner_rows = x.shape[1] if x.dim() == 3 else 1
    has_residual = residual is not None and residual_out is not None
    r, ro = (residual, residual_out) if has_residual else (x, out)  # placeholders when unused
    source = x if x_parts is None else x_parts[0]
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x if x_parts is None else x_parts, r, weight, out, ro, num_rows, inner_rows, num_cols, eps,
        *_row_strides(source), *_row_strides(r), *_row_strides(out), *_row_strides(ro),
        0 if x_parts is None else x_parts.stride(0), HAS_RESIDUAL=has_residual,
        X_PARTS=0 if x_parts is None else x_parts.shape[0], BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=num_warps, **pdl.launch_options(x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, N] or [T, heads, N] (a strided view is fine); reference.rms_norm."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # like x, contiguous
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """summed = x + residual (in x.dtype), then RMSNorm of it: returns (normed, summed), new tensors, both
    [T, N]; reference.add_rms_norm. With residual None: (rms_norm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, N]
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, N]
    _launch(x, residual, weight, eps, out, summed)
    return out, summed


def add_rms_norm_parts(parts: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x, residual, ...) where x = the sum over S of parts [S, T, N], in fp32 in order, rounded to dtype
    (fp8_weight_only.DeferredSum: a split-K GEMM's fp32 partial sums, or an MoE layer's top-k expert outputs in
    dtype, any strides along S and T), without x ever written: one launch for the sum, the residual add and the
    norm."""
    if (parts.dim() != 3 or parts.dtype not in (torch.float32, dtype) or parts.stride(2) != 1
            or parts.shape[0] < 1):
        raise ValueError(f"parts must be fp32 or {dtype} [S, T, N] with N contiguous, got {tuple(parts.shape)} "
                         f"{parts.dtype} strides {parts.stride()}")
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)  # [T, N]
    _check("residual", residual, out)
    summed = torch.empty_like(out)  # [T, N]
    _launch(out, residual, weight, eps, out, summed, x_parts=parts)  # out stands for x's shape and dtype
    return out, summed
