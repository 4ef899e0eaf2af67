"""Triton kernels for the paged KV cache: write this step's K/V rows into their slots; dequantize listed blocks of an
fp8 cache into a 16-bit copy."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.fp8 import FP8_MAX_C, round_to_e4m3

_MAX_HEAD_DIM = 256
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr,
                     HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """One program per token: copy its [kv_heads, head_dim] K and V rows to slot_mapping[token]. FP8: store
    k / k_scale and v / v_scale clamped to +-448, rounded to e4m3."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (CUDA-graph batch filler): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [HEADS_P, HEAD_DIM_P]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:
        k = round_to_e4m3(tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -FP8_MAX_C, FP8_MAX_C))
        v = round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -FP8_MAX_C, FP8_MAX_C))
    # Else a pure copy (with the cache-dtype cast the reference does): no arithmetic, no fp32 upcast needed.
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots (block_id * block_size + offset) of the caches
    [num_blocks, block_size, kv_heads, head_dim]; slot -1 is padding and is skipped. An fp8 (e4m3) cache
    needs k_scale, v_scale [1] fp32 and stores k / k_scale, v / v_scale (as reference.write_kv). k and v may
    be strided views (e.g. of the fused qkv output) as long as head_dim is contiguous. Slots must be
    < num_blocks * block_size (not checked: it would cost a device sync)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, kv_heads, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache rows {tuple(k_cache.shape[2:])} != k rows {tuple(k.shape[1:])}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {_MAX_HEAD_DIM}, got {head_dim}")
    if (not k.dtype.is_floating_point or v.dtype != k.dtype or k_cache.dtype not in _CACHE_DTYPES
            or v_cache.dtype != k_cache.dtype):
        raise ValueError(f"k/v and the caches must be float tensors, pairwise of one dtype, got {k.dtype}, "
                         f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if (slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or not slot_mapping.is_contiguous()):
        raise ValueError(f"slot_mapping must be [T={num_tokens}] int32/int64 contiguous, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k, v and the caches must be contiguous along head_dim")
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError(f"all tensors must be on one device, got k on {k.device}, v on {v.device}, caches on "
                         f"{k_cache.device} and {v_cache.device}, slot_mapping on {slot_mapping.device}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and not all(s is not None and s.shape == (1,) and s.dtype == torch.float32 and s.device == k.device
                       for s in (k_scale, v_scale)):
        raise ValueError("an fp8 cache needs k_scale and v_scale as [1] fp32 tensors on the caches' device")
    if num_tokens == 0:
        return
    heads_p, head_dim_p = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_P=heads_p, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=k_cache.shape[1], FP8=fp8, num_warps=4 if heads_p * head_dim_p <= 2048 else 8)


@triton.jit
def _dequantize_blocks_kernel(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_ids_ptr, k_out_ptr,
                              v_out_ptr, stride_kb, stride_vb, BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (i, part): elements [part * CHUNK, (part + 1) * CHUNK) of cache block block_ids[i], K and V, as
    e4m3 * scale (fp32 product, one rounding to the output dtype) into row i of the outputs."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    k = tl.load(k_cache_ptr + block * stride_kb + offs, mask=mask).to(tl.float32) * tl.load(k_scale_ptr)
    v = tl.load(v_cache_ptr + block * stride_vb + offs, mask=mask).to(tl.float32) * tl.load(v_scale_ptr)
    tl.store(k_out_ptr + i * BLOCK_ELEMS + offs, k.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + i * BLOCK_ELEMS + offs, v.to(v_out_ptr.dtype.element_ty), mask=mask)


def dequantize_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                      block_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed blocks of an fp8 (e4m3) cache pair [num_blocks, block_size, kv_heads, head_dim], dequantized
    (e4m3 * its per-tensor scale, as reference.dequantize_blocks): block_ids [n] int32/int64 ->
    (k, v) [n, block_size, kv_heads, head_dim] in dtype, row i the copy of block block_ids[i]. For paged attention
    over a 16-bit scratch copy of the blocks a batch of long chunks references (each block converted once, not
    once per query tile). Ids must be < num_blocks (not checked: it would cost a device sync)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"caches must be float8_e4m3fn, got {k_cache.dtype} and {v_cache.dtype}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for cache in (k_cache, v_cache):  # each block one contiguous run of elements
        if cache.stride()[1:] != (num_kv_heads * head_dim, head_dim, 1):
            raise ValueError(f"each cache block must be contiguous, got strides {cache.stride()}")
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64) or not block_ids.is_contiguous():
        raise ValueError(f"block_ids must be [n] int32/int64 contiguous, got {tuple(block_ids.shape)} "
                         f"{block_ids.dtype}")
    if not all(s.shape == (1,) and s.dtype == torch.float32 for s in (k_scale, v_scale)):
        raise ValueError("k_scale and v_scale must be [1] fp32 tensors")
    if not (k_cache.device == v_cache.device == block_ids.device == k_scale.device == v_scale.device):
        raise ValueError("all tensors must be on one device")
    shape = (block_ids.shape[0], block_size, num_kv_heads, head_dim)
    k_out = torch.empty(shape, dtype=dtype, device=k_cache.device)  # [n, block_size, kv_heads, head_dim]
    v_out = torch.empty(shape, dtype=dtype, device=k_cache.device)  # [n, block_size, kv_heads, head_dim]
    if block_ids.shape[0] == 0:
        return k_out, v_out
    block_elems = block_size * num_kv_heads * head_dim
    chunk = min(4096, triton.next_power_of_2(block_elems))
    _dequantize_blocks_kernel[(block_ids.shape[0], triton.cdiv(block_elems, chunk))](
        k_cache, v_cache, k_scale, v_scale, block_ids, k_out, v_out, k_cache.stride(0), v_cache.stride(0),
        BLOCK_ELEMS=block_elems, CHUNK=chunk, num_warps=4)
    return k_out, v_out
