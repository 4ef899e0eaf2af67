"""Triton rotate-half rotary embedding applied to q and k together, from per-token cos/sin or a cos/sin cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to the nearest value of the storage dtype (ties to even), kept in fp32. For bf16 this is
    integer arithmetic on purpose: Triton turns `(a * b).to(bf16).to(fp32) + (c * d).to(bf16).to(fp32)` into
    a bf16 multiply and a bf16 FMA, which rounds c * d only once (11% of the outputs differed from PyTorch on
    an H200). fp16 keeps the plain conversion (it may be fused the same way); fp32 needs no rounding."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, c1, c2, s1, s2,
                  NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """out = x * cos + rotate_half(x) * sin for the heads of one token; rotate_half(x) = [-x2, x1]."""
    offs_h = tl.arange(0, HEADS_P)
    offs_c = tl.arange(0, HALF_P)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_c < HALF)[None, :]  # [HEADS_P, HALF_P]
    x_row = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_c[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)  # [HEADS_P, HALF_P]
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    # Both halves are loaded before either store, so out may alias x (in place).
    # Each product is rounded to the storage dtype before the sum, as x * cos + rotate_half(x) * sin does in
    # PyTorch (and so in Hugging Face models): bf16 results then match the reference bit for bit.
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    o1 = _round_to(x1 * c1[None, :], dtype) + _round_to(-x2 * s1[None, :], dtype)
    o2 = _round_to(x2 * c2[None, :], dtype) + _round_to(x1 * s2[None, :], dtype)
    out_row = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(out_row, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cos_sin_halves(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Row `row` of the cos and sin caches as fp32 halves [HALF_P] each (c1, c2, s1, s2). Both halves are read
    (not assumed equal), to keep the reference's exact semantics."""
    offs_c = tl.arange(0, HALF_P)
    c_mask = offs_c < HALF
    c1 = tl.load(cos_ptr + row * stride_cos + offs_c, mask=c_mask, other=0.0).to(tl.float32)  # [HALF_P]
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, positions_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_cos, stride_sin,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
                 KV_HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """One program per token: all its q and k heads share one load of the token's cos/sin row."""
    token = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:  # cos/sin are a cache indexed by position
        row = tl.load(positions_ptr + token).to(tl.int64)
    else:  # cos/sin hold one row per token
        row = token
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HALF, HALF_P)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, c1, c2, s1, s2,
                  NUM_HEADS, HEADS_P, HALF, HALF_P)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, c1, c2, s1, s2,
                  NUM_KV_HEADS, KV_HEADS_P, HALF, HALF_P)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor | None = None,
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] (strided views fine) by position: reference.apply_rope on
    each. Without positions, cos/sin are [T, D] (row t for token t); with positions [T], cos/sin are a cache
    [max_pos, D] and token t uses row positions[t] (positions < max_pos is not checked: a device sync).
    inplace=False returns new contiguous tensors; inplace=True writes q and k themselves and returns them."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, heads, D] and k [T, kv_heads, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotate-half rope needs an even head_dim, got {head_dim}")
    if not q.dtype.is_floating_point or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a float dtype, got {q.dtype} and {k.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(f"cos and sin must both be [rows, {head_dim}], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if not cos.dtype.is_floating_point or sin.dtype != cos.dtype:
        raise ValueError(f"cos/sin must share a float dtype, got {cos.dtype} and {sin.dtype}")
    if positions is None and cos.shape[0] != num_tokens:
        raise ValueError(f"cos/sin need one row per token ({num_tokens}), got {cos.shape[0]}")
    if positions is not None and (positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64)
                                  or not positions.is_contiguous()):
        raise ValueError(f"positions must be [T={num_tokens}] int32/int64 contiguous, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("q, k, cos and sin must be contiguous along head_dim")
    if not (q.device == k.device == cos.device == sin.device
            and (positions is None or positions.device == q.device)):
        raise ValueError(f"all tensors must be on q's device {q.device}")
    if inplace:
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, heads, D]
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [T, kv_heads, D]
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    heads_p, kv_heads_p = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    _rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, cos, sin, positions if positions is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_P=heads_p, KV_HEADS_P=kv_heads_p,
        HALF=half, HALF_P=triton.next_power_of_2(half), HAS_POSITIONS=positions is not None,
        num_warps=4 if heads_p * half <= 2048 else 8)
    return q_out, k_out
