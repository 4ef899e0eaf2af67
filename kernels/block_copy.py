"""Triton kernel that copies whole KV blocks inside the cache: beam search's copy of a parent's last, partial block
into the block its child owns, planned on the device (no host sync: pairs that copy nothing are skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # bytes a program moves per iteration


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, stride_plane, stride_block, BLOCK_BYTES: tl.constexpr,
                        CHUNK: tl.constexpr):
    """One program per (pair, plane): block src[pair] -> block dst[pair] of that plane, unless they are equal."""
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    if src == dst:
        return
    base = cache_ptr + plane * stride_plane
    for start in range(0, BLOCK_BYTES, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_BYTES
        tl.store(base + dst * stride_block + offs, tl.load(base + src * stride_block + offs, mask=mask), mask=mask)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache [planes, num_blocks, ...] (contiguous; a plane is one layer's K or V): block src[i] -> dst[i] [N] in
    every plane, pairs with src == dst skipped. Destinations of copying pairs are distinct and none is the source
    of another pair (as reference.copy_blocks). Ids must be < num_blocks (not checked: it would cost a sync)."""
    if cache.dim() < 2 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [planes, num_blocks, ...] tensor, got {tuple(cache.shape)}")
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be [N] alike, got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.dtype not in (torch.int32, torch.int64) or dst.dtype != src.dtype:
        raise ValueError(f"block ids must be int32 or int64, got {src.dtype} and {dst.dtype}")
    if not (src.device == dst.device == cache.device):
        raise ValueError("cache and block ids must be on one device")
    if src.numel() == 0:
        return
    planes, num_blocks = cache.shape[:2]
    raw = cache.view(torch.uint8).view(planes, num_blocks, -1)  # [planes, num_blocks, bytes a block]
    _copy_blocks_kernel[(src.numel(), planes)](raw, src, dst, raw.stride(0), raw.stride(1),
                                               BLOCK_BYTES=raw.shape[2], CHUNK=_CHUNK)
