"""Triton kernel that turns one step's fused qkv rows into attention inputs in one pass: optional per-head RMSNorm
of q and k (Qwen3), rotary embedding of both, q written back in place, k and v stored into the paged KV cache.

It replaces four launches per layer (q norm, k norm, rope, K/V write) and three round trips of q and k through
memory; semantics are those of reference.prepare_qkv (the same roundings to the storage dtype, step by step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.fp8 import FP8_MAX_C, round_to_e4m3
from pagoda.kernels.fp8_weight_only import DeferredSum
from pagoda.kernels.rope import _round_to, cos_sin_halves

_MAX_HEAD_DIM = 256
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@triton.jit
def _norm_halves(x1, x2, weight_ptr, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                 DTYPE: tl.constexpr):
    """RMSNorm of rows split into halves [R, HALF_P] each: fp32 statistics, the normalised row rounded to DTYPE,
    then the weight product rounded again (as reference.rms_norm)."""
    offs_c = tl.arange(0, HALF_P)
    c_mask = offs_c < HALF
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)  # [R]
    w1 = tl.load(weight_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)  # [HALF_P]
    w2 = tl.load(weight_ptr + HALF + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    n1 = _round_to(_round_to(x1 * rstd[:, None], DTYPE) * w1[None, :], DTYPE)
    n2 = _round_to(_round_to(x2 * rstd[:, None], DTYPE) * w2[None, :], DTYPE)
    return n1, n2


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
    """x * cos + rotate_half(x) * sin with each product rounded to DTYPE before the sum (as reference.apply_rope)."""
    o1 = _round_to(x1 * c1[None, :], DTYPE) + _round_to(-x2 * s1[None, :], DTYPE)
    o2 = _round_to(x2 * c2[None, :], DTYPE) + _round_to(x1 * s2[None, :], DTYPE)
    return _round_to(o1, DTYPE), _round_to(o2, DTYPE)


@triton.jit
def _to_cache(x, scale_ptr, CACHE_DTYPE: tl.constexpr, FP8: tl.constexpr):
    """fp32 x as stored in the cache: cast, or for fp8 x / scale clamped to +-448 and rounded to e4m3 (as
    write_kv). One return of one type: compiled Triton refuses branches returning different dtypes."""
    if FP8:
        x = round_to_e4m3(tl.clamp(tl.math.div_rn(x, tl.load(scale_ptr)), -FP8_MAX_C, FP8_MAX_C))
    return x.to(CACHE_DTYPE)


@triton.jit
def _qkv_prep_kernel(qkv_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, k_cache_ptr,
                     v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, eps,
                     stride_t, stride_s, stride_qo, stride_cos, stride_sin, stride_kcb, stride_kcs, stride_kch,
                     stride_vcb, stride_vcs, stride_vch,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
                     KV_HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr, X_PARTS: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Grid (tokens, 2): program (t, 0) writes token t's q heads to q_out (qkv itself: in place), (t, 1) stores
    its k and v heads (two programs a token keep small decode batches from running on too few SMs). Row layout of
    qkv: [q heads | k heads | v heads], each head HEAD_DIM = 2 * HALF. X_PARTS > 1: qkv is a split-K GEMM's fp32
    partial sums [X_PARTS, T, width] (stride_s apart), each value their in-order sum rounded to q_out's dtype, as
    the GEMM's own sum kernel rounds it."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    DTYPE: tl.constexpr = q_out_ptr.dtype.element_ty
    CACHE_DTYPE: tl.constexpr = k_cache_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(positions_ptr + token).to(tl.int64)
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HALF, HALF_P)  # [HALF_P] each
    base = qkv_ptr + token * stride_t
    if tl.program_id(1) == 0:
        _prep_q(base, q_out_ptr + token * stride_qo, stride_s, q_norm_ptr, eps, c1, c2, s1, s2, NUM_HEADS,
                HEADS_P, HALF, HALF_P, QK_NORM, X_PARTS, DTYPE)
    else:
        _prep_kv(base, stride_s, k_norm_ptr, eps, c1, c2, s1, s2, token, k_cache_ptr, v_cache_ptr,
                 slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                 stride_vcs, stride_vch, NUM_HEADS, NUM_KV_HEADS, KV_HEADS_P, HALF, HALF_P, BLOCK_SIZE, QK_NORM, FP8,
                 X_PARTS, DTYPE, CACHE_DTYPE)


@triton.jit
def _load_halves(ptrs, mask, stride_s, HALF: tl.constexpr, X_PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """Both halves of heads at ptrs in fp32 [R, HALF_P] each; X_PARTS > 1: the in-order fp32 sum of that many
    partials stride_s apart, rounded to DTYPE (the split-K sum kernel's rounding: a plain cast)."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if X_PARTS > 1:
        for part in tl.static_range(1, X_PARTS):
            x1 += tl.load(ptrs + part * stride_s, mask=mask, other=0.0)
            x2 += tl.load(ptrs + part * stride_s + HALF, mask=mask, other=0.0)
        x1 = x1.to(DTYPE).to(tl.float32)
        x2 = x2.to(DTYPE).to(tl.float32)
    return x1, x2


@triton.jit
def _prep_q(base, q_out, stride_s, q_norm_ptr, eps, c1, c2, s1, s2, NUM_HEADS: tl.constexpr,
            HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, QK_NORM: tl.constexpr,
            X_PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """One token's q heads: norm, rope, written to q_out (heads contiguous, HEAD_DIM apart)."""
    HEAD_DIM: tl.constexpr = 2 * HALF
    offs_c = tl.arange(0, HALF_P)
    c_mask = offs_c < HALF
    offs_h = tl.arange(0, HEADS_P)
    q_mask = (offs_h < NUM_HEADS)[:, None] & c_mask[None, :]  # [HEADS_P, HALF_P]
    head_offsets = offs_h[:, None] * HEAD_DIM + offs_c[None, :]
    q1, q2 = _load_halves(base + head_offsets, q_mask, stride_s, HALF, X_PARTS, DTYPE)  # [HEADS_P, HALF_P] each
    if QK_NORM:
        q1, q2 = _norm_halves(q1, q2, q_norm_ptr, eps, HEAD_DIM, HALF, HALF_P, DTYPE)
    q1, q2 = _rotate(q1, q2, c1, c2, s1, s2, DTYPE)
    tl.store(q_out + head_offsets, q1.to(DTYPE), mask=q_mask)
    tl.store(q_out + head_offsets + HALF, q2.to(DTYPE), mask=q_mask)


@triton.jit
def _prep_kv(base, stride_s, k_norm_ptr, eps, c1, c2, s1, s2, token, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
             k_scale_ptr, v_scale_ptr, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_P: tl.constexpr, HALF: tl.constexpr,
             HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr,
             X_PARTS: tl.constexpr, DTYPE: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """One token's k heads (norm, rope) and v heads, stored into the caches at the token's slot."""
    HEAD_DIM: tl.constexpr = 2 * HALF
    offs_c = tl.arange(0, HALF_P)
    c_mask = offs_c < HALF
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # else a padding token (CUDA-graph batch filler): no K/V to store
        offs_kh = tl.arange(0, KV_HEADS_P)
        kv_mask = (offs_kh < NUM_KV_HEADS)[:, None] & c_mask[None, :]  # [KV_HEADS_P, HALF_P]
        k_ptrs = base + NUM_HEADS * HEAD_DIM + offs_kh[:, None] * HEAD_DIM + offs_c[None, :]
        k1, k2 = _load_halves(k_ptrs, kv_mask, stride_s, HALF, X_PARTS, DTYPE)  # [KV_HEADS_P, HALF_P] each
        if QK_NORM:
            k1, k2 = _norm_halves(k1, k2, k_norm_ptr, eps, HEAD_DIM, HALF, HALF_P, DTYPE)
        k1, k2 = _rotate(k1, k2, c1, c2, s1, s2, DTYPE)
        v1, v2 = _load_halves(k_ptrs + NUM_KV_HEADS * HEAD_DIM, kv_mask, stride_s, HALF, X_PARTS, DTYPE)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_kh[:, None] * stride_kch + offs_c[None, :]
        vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_kh[:, None] * stride_vch + offs_c[None, :]
        tl.store(kc, _to_cache(k1, k_scale_ptr, CACHE_DTYPE, FP8), mask=kv_mask)
        tl.store(kc + HALF, _to_cache(k2, k_scale_ptr, CACHE_DTYPE, FP8), mask=kv_mask)
        tl.store(vc, _to_cache(v1, v_scale_ptr, CACHE_DTYPE, FP8), mask=kv_mask)
        tl.store(vc + HALF, _to_cache(v2, v_scale_ptr, CACHE_DTYPE, FP8), mask=kv_mask)


def _check(qkv: torch.Tensor, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
           q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """ValueError on anything the kernel relies on (runs every layer of every step: messages built on failure).
    qkv: the rows (of the first partial sum, for partials); dtype: the model's, q's."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] contiguous along its last dim, got {tuple(qkv.shape)}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qkv dtype {dtype} is not a float type")
    if head_dim % 2 or not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and in 2..{_MAX_HEAD_DIM}, got {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != dtype
                                   or not weight.is_contiguous() or weight.device != qkv.device):
            raise ValueError(f"{name} must be [{head_dim}] {dtype} contiguous on {qkv.device}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != head_dim or cos.stride(1) != 1 \
            or sin.stride(1) != 1 or cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin must both be [positions, {head_dim}] of one dtype, contiguous rows")
    num_tokens = qkv.shape[0]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (num_tokens,) or index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous():
            raise ValueError(f"{name} must be [T={num_tokens}] int32/int64 contiguous, got {tuple(index.shape)} "
                             f"{index.dtype}")
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim)
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1):
        raise ValueError(f"caches must both be [num_blocks, block_size, {num_kv_heads}, {head_dim}] contiguous "
                         f"along head_dim, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"unsupported cache dtypes {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dtype == torch.float8_e4m3fn and not all(
            s is not None and s.shape == (1,) and s.dtype == torch.float32 and s.device == qkv.device
            for s in (k_scale, v_scale)):
        raise ValueError("an fp8 cache needs k_scale and v_scale as [1] fp32 tensors on qkv's device")
    if not all(t.device == qkv.device for t in (cos, sin, positions, k_cache, v_cache, slot_mapping)):
        raise ValueError(f"all tensors must be on qkv's device {qkv.device}")


def prepare_qkv(qkv: torch.Tensor | DeferredSum, num_heads: int, num_kv_heads: int, head_dim: int,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D] -> q [T, heads, D], a view of qkv rewritten in place (normalised if
    q_norm is given, then rotated); k (likewise) and v go to flat slots of the caches [num_blocks, block_size,
    kv_heads, D] (slot -1: padding, skipped). cos/sin [max_pos, D] are indexed by positions [T]. Same result
    as reference.prepare_qkv. qkv may be a split-K GEMM's DeferredSum (fp32 partials [S, T, width]): the qkv rows
    are their rounded sum, never written (one launch fewer a layer), and q comes back in a new tensor. Not checked
    (a device sync): positions < max_pos, slots within the caches."""
    parts = qkv.parts if isinstance(qkv, DeferredSum) else None
    rows = qkv if parts is None else parts[0]  # [T, width]
    assert isinstance(rows, torch.Tensor)
    dtype = qkv.dtype
    _check(rows, dtype, num_heads, num_kv_heads, head_dim, q_norm, k_norm, cos, sin, positions, k_cache, v_cache,
           slot_mapping, k_scale, v_scale)
    if parts is not None and (parts.dtype != torch.float32 or parts.stride(2) != 1):
        raise ValueError(f"qkv partials must be fp32 [S, T, width] contiguous along width, got {parts.dtype} "
                         f"strides {parts.stride()}")
    num_tokens = rows.shape[0]
    if parts is None:
        q = rows[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # [T, heads, D]
    else:
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device=rows.device)  # [T, heads, D]
    if num_tokens == 0:
        return q
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    half = head_dim // 2
    heads_p = triton.next_power_of_2(num_heads)
    pdl_options = pdl.launch_options(rows.device)
    source = rows if parts is None else parts
    _qkv_prep_kernel[(num_tokens, 2)](
        source, rows if parts is None else q, q_norm if q_norm is not None else rows,
        k_norm if k_norm is not None else rows, cos, sin, positions, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else cos, v_scale if fp8 else cos, eps,
        rows.stride(0), 0 if parts is None else parts.stride(0), rows.stride(0) if parts is None else q.stride(0),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_P=heads_p,
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads), HALF=half, HALF_P=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1], QK_NORM=q_norm is not None, FP8=fp8,
        X_PARTS=1 if parts is None else parts.shape[0],
        num_warps=4 if heads_p * half <= 2048 else 8, **pdl_options)
    return q
