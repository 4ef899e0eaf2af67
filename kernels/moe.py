"""Fused mixture-of-experts in Triton: route tokens to their top-k experts, sort the (token, slot) pairs by expert
into BLOCK_M-row tiles, then one grouped GEMM for gate+up with SiLU-and-mul in its epilogue and one for down with
the routing weight applied; the top-k sum closes the layer.

Every buffer has a shape fixed by (tokens, top_k, experts, BLOCK_M), never by the routing, so a decode step
captures in a CUDA graph: tiles past the routed ones exit at once. Expert weights are in the model dtype, or e4m3
with fp32 scales per output row and K-group (weight-only FP8: converted in registers, no activation quantization).

    pairs p = t * top_k + j  (token t's j-th expert)
    sorted_pairs [max_padded]: pair ids grouped by expert, each expert's run padded to BLOCK_M with `num_pairs`
    tile_experts [max_tiles]: the expert of each BLOCK_M tile, -1 for tiles past the routed ones
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("moe_configs")


# ---------------------------------------------------------------- routing


def route_softmax_topk(router_logits: torch.Tensor, top_k: int,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int32): softmax in fp32, the k largest
    (ties: the lower expert id first, as torch.topk), renormalised to sum 1 where the config says so."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# ---------------------------------------------------------------- alignment


@triton.jit
def _align_kernel(topk_ids_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr, counts_ptr, cursor_ptr,
                  num_pairs, max_padded, max_tiles,
                  NUM_EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """One program: count pairs per expert, pad each count to BLOCK_M, lay the experts' runs end to end, then
    place every pair in its expert's run (the order inside a run is free: the top-k sum does not depend on it)."""
    offs_e = tl.arange(0, EXPERTS_P)
    e_mask = offs_e < NUM_EXPERTS
    tl.store(counts_ptr + offs_e, tl.zeros([EXPERTS_P], dtype=tl.int32), mask=e_mask)
    for start in range(0, max_padded, CHUNK):  # padding rows point past the last pair
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=offs < max_padded)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        tl.atomic_add(counts_ptr + expert, tl.full([CHUNK], 1, tl.int32), mask=mask)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)  # [E_P]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)  # [E_P]: where each expert's run ends
    run_start = run_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + offs_e, run_start, mask=e_mask)
    tile_end = run_end // BLOCK_M  # [E_P]: tiles [start, end) of expert e
    for start in range(0, max_tiles, TILE_CHUNK):
        tiles = start + tl.arange(0, TILE_CHUNK)  # [TC]
        # a tile's expert: how many runs end at or before it
        ended = (tiles[:, None] >= tile_end[None, :]) & e_mask[None, :]  # [TC, E_P]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        expert = tl.where(tiles * BLOCK_M < total, expert, -1)
        tl.store(tile_experts_ptr + tiles, expert, mask=tiles < max_tiles)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        slot = tl.atomic_add(cursor_ptr + expert, tl.full([CHUNK], 1, tl.int32), mask=mask)
        tl.store(sorted_pairs_ptr + slot, offs.to(tl.int32), mask=mask)


@dataclass(frozen=True, slots=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32
    tile_experts: torch.Tensor  # [max_tiles] int32
    num_padded: torch.Tensor  # [1] int32: rows of sorted_pairs in use (a multiple of block_m)
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout in the worst case: every expert's run padded by block_m - 1."""
    return num_pairs + num_experts * (block_m - 1)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [T, k] int32 -> the pairs grouped by expert in block_m tiles (shapes fixed by T, k, E, block_m)."""
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
    num_pairs = topk_ids.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    max_tiles = -(-max_padded // block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)  # [max_padded]
    tile_experts = torch.empty(max_tiles, dtype=torch.int32, device=device)  # [max_tiles]
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    scratch = torch.empty(2, num_experts, dtype=torch.int32, device=device)  # counts, cursors
    experts_p = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](topk_ids, sorted_pairs, tile_experts, num_padded, scratch[0], scratch[1],
                        num_pairs, max_padded, max_tiles, NUM_EXPERTS=num_experts, EXPERTS_P=experts_p,
                        BLOCK_M=block_m, CHUNK=1024, TILE_CHUNK=max(16, 4096 // experts_p), num_warps=4)
    return Alignment(sorted_pairs, tile_experts, num_padded, block_m)


# ---------------------------------------------------------------- grouped GEMM


@triton.jit
def _load_weight_tile(w_ptrs, scale_ptrs, k_left, offs_k, n_mask, k0, IS_FP8: tl.constexpr,
                      GROUP_K: tl.constexpr, stride_sg, compute_dtype: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile in the activation dtype (e4m3 converted and scaled in registers)."""
    if EVEN_K and EVEN_N:
        w = tl.load(w_ptrs)
    else:
        mask = (offs_k[:, None] < k_left) & n_mask[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0)
    if IS_FP8:
        scale = tl.load(scale_ptrs + (k0 // GROUP_K) * stride_sg, mask=n_mask, other=0.0)  # [BLOCK_N]
        w = (w.to(tl.float32) * scale[None, :]).to(compute_dtype)
    return w


@triton.jit
def _moe_gemm_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr, topk_weights_ptr,
        N, K, num_pairs,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
        stride_om, stride_on,
        A_ROWS_PER_PAIR: tl.constexpr,  # top_k when A is indexed by token (pair // top_k), 1 when by pair
        FUSE_SILU: tl.constexpr,  # W holds [gate; up] rows (N each): out = silu(x @ gate.T) * (x @ up.T)
        MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
        IS_FP8: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair, n] = act(A[row(pair)] @ W[expert(pair)].T)[n] for the BLOCK_M pairs of one tile."""
    pid = tl.program_id(0)
    num_tiles_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each column sweep (their expert's weights stay in L2)
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)  # [BLOCK_M]
    m_mask = pairs < num_pairs
    rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    w_ptrs = w_base + offs_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]: W[e, n, k] read transposed
    s_ptrs = scale_ptr + expert * stride_se + offs_n * stride_sn
    compute_dtype: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FUSE_SILU:
        up_ptrs = w_ptrs + N * stride_wn
        up_s_ptrs = s_ptrs + N * stride_sn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = _load_weight_tile(w_ptrs, s_ptrs, k_left, offs_k, n_mask, k0, IS_FP8, GROUP_K, stride_sg,
                              compute_dtype, EVEN_K, EVEN_N)
        acc += tl.dot(a, w)
        if FUSE_SILU:
            up = _load_weight_tile(up_ptrs, up_s_ptrs, k_left, offs_k, n_mask, k0, IS_FP8, GROUP_K, stride_sg,
                                   compute_dtype, EVEN_K, EVEN_N)
            acc_up += tl.dot(a, up)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if FUSE_SILU:
        # the gate is rounded to the storage dtype before silu, as F.silu(gate) * up does on model-dtype tensors
        gate = acc.to(compute_dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(compute_dtype).to(tl.float32) * acc_up.to(compute_dtype).to(
            tl.float32)
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc.to(compute_dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, group_k: int | None,
              align: Alignment, out: torch.Tensor, num_pairs: int, rows_per_pair: int, fuse_silu: bool,
              topk_weights: torch.Tensor | None, tile: TileConfig) -> None:
    n = w.shape[1] // 2 if fuse_silu else w.shape[1]
    k = w.shape[2]
    is_fp8 = w.dtype == torch.float8_e4m3fn
    scale = w_scale if is_fp8 else out  # unused pointer when not fp8
    assert not is_fp8 or (w_scale is not None and group_k is not None)
    assert not is_fp8 or group_k is None or group_k >= k or group_k % tile.block_k == 0, "K-tile crosses a scale group"
    stride_s = w_scale.stride() if is_fp8 and w_scale is not None else (0, 0, 0)
    max_tiles = align.tile_experts.numel()
    grid = (max_tiles * triton.cdiv(n, tile.block_n),)
    _moe_gemm_kernel[grid](
        a, w, scale, out, align.sorted_pairs, align.tile_experts, align.num_padded,
        topk_weights if topk_weights is not None else out,
        n, k, num_pairs,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), *stride_s,
        out.stride(0), out.stride(1),
        A_ROWS_PER_PAIR=rows_per_pair, FUSE_SILU=fuse_silu, MUL_WEIGHT=topk_weights is not None,
        IS_FP8=is_fp8, GROUP_K=group_k or k, EVEN_K=k % tile.block_k == 0, EVEN_N=n % tile.block_n == 0,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


# ---------------------------------------------------------------- tuned tiles


def _bucket(num_tokens: int) -> int:
    """Token counts share a tile configuration per power of two."""
    return 1 << max(0, math.ceil(math.log2(max(num_tokens, 1))))


def default_tile(num_tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """A reasonable tile for any shape: small row tiles when experts see few tokens each."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 4:
        return TileConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 32:
        return TileConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
    return TileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)


def config_file_name(num_experts: int, intermediate: int, hidden: int, dtype: str, device_name: str) -> str:
    device = device_name.replace(" ", "_")
    return f"E={num_experts},I={intermediate},H={hidden},dtype={dtype},device={device},triton={triton.__version__}.json"


@lru_cache(maxsize=16)
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


@lru_cache(maxsize=64)
def _tuned_table(file_name: str) -> dict[int, dict[str, TileConfig]] | None:
    path = CONFIG_DIR / file_name
    if not path.is_file():
        log.info("no tuned MoE tiles %s: default tiles (bench/moe_tune.py writes them)", file_name)
        return None
    raw = json.loads(path.read_text())
    return {int(bucket): {name: TileConfig(**tile) for name, tile in tiles.items()} for bucket, tiles in raw.items()}


def pick_tiles(num_tokens: int, top_k: int, num_experts: int, intermediate: int, hidden: int,
               dtype: torch.dtype, device: torch.device) -> tuple[TileConfig, TileConfig]:
    """(gate_up tile, down tile) for this shape: the tuned table's nearest bucket, else the default."""
    if device.type == "cuda":
        name = config_file_name(num_experts, intermediate, hidden, str(dtype).removeprefix("torch."),
                                _device_name(device.index))
        table = _tuned_table(name)
        if table:
            bucket = min(table, key=lambda b: abs(math.log2(b) - math.log2(_bucket(num_tokens))))
            entry = table[bucket]
            return entry["gate_up"], entry["down"]
    tile = default_tile(num_tokens, top_k, num_experts)
    return tile, tile


# ---------------------------------------------------------------- the layer


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None, group_k: int | None = None,
                  tiles: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    x [T, H]; w_gate_up [E, 2I, H] (gate rows then up rows); w_down [E, H, I]; topk_weights [T, k] fp32;
    topk_ids [T, k] int32. FP8 weights: e4m3 with scales [E, rows, K / group_k] (group_k = K: per row).
    Returns [T, H] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    _check_experts(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, group_k)
    if tiles is None:
        tiles = pick_tiles(num_tokens, top_k, num_experts, inter, hidden, x.dtype, x.device)
    up_tile, down_tile = tiles
    fp8_block_k = group_k if w_gate_up.dtype == torch.float8_e4m3fn else None
    if fp8_block_k is not None:  # a K-tile must stay inside one scale group
        up_tile = _fit_block_k(up_tile, fp8_block_k, hidden)
        down_tile = _fit_block_k(down_tile, fp8_block_k, inter)
    num_pairs = num_tokens * top_k
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.contiguous().view(-1)  # [T * k]
    align_up = align_pairs(topk_ids, num_experts, up_tile.block_m)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    _moe_gemm(x, w_gate_up, w_gate_up_scale, _group(group_k, hidden), align_up, act, num_pairs, top_k, True, None,
              up_tile)
    align_down = align_up if down_tile.block_m == up_tile.block_m else align_pairs(topk_ids, num_experts,
                                                                                    down_tile.block_m)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T * k, H]
    _moe_gemm(act, w_down, w_down_scale, _group(group_k, inter), align_down, out, num_pairs, 1, False, weights,
              down_tile)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H]


def _group(group_k: int | None, k: int) -> int:
    return k if group_k is None else group_k


def _fit_block_k(tile: TileConfig, group_k: int, k: int) -> TileConfig:
    group = min(group_k, k)
    block_k = tile.block_k
    while group % block_k and block_k > 16:
        block_k //= 2
    assert group % block_k == 0, f"FP8 scale group {group} is not a multiple of 16"
    return TileConfig(tile.block_m, tile.block_n, block_k, tile.group_m, tile.num_warps, tile.num_stages)


def _check_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None,
                   group_k: int | None) -> None:
    num_experts, two_i, hidden = w_gate_up.shape
    assert x.dim() == 2 and x.shape[1] == hidden, (x.shape, w_gate_up.shape)
    assert w_down.shape == (num_experts, hidden, two_i // 2), (w_down.shape, w_gate_up.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    if w_gate_up.dtype == torch.float8_e4m3fn:
        assert w_down.dtype == torch.float8_e4m3fn and w_gate_up_scale is not None and w_down_scale is not None
        group_up, group_down = _group(group_k, hidden), _group(group_k, two_i // 2)
        assert w_gate_up_scale.shape == (num_experts, two_i, -(-hidden // group_up)), w_gate_up_scale.shape
        assert w_down_scale.shape == (num_experts, hidden, -(-(two_i // 2) // group_down)), w_down_scale.shape
    else:
        assert w_gate_up.dtype == w_down.dtype == x.dtype, (x.dtype, w_gate_up.dtype, w_down.dtype)
