"""Triton kernels for DeepSeek's multi-head latent attention (MLA) over a paged latent cache.

The cache of one layer is `[num_blocks, block_size, kv_lora_rank + rope_dim]`: one entry per token, the
normalised latent c_kv followed by the rotated shared rope key k_pe (576 values for DeepSeek V2/V3), in the
model dtype or fp8 e4m3 with one per-tensor scale. Every query head reads the same entry.

- `write_latent`: store this step's [c_kv ‖ k_pe] rows at their slots; `mla_prepare` does that from the kv_a
  projection's rows in one launch with the kv_a RMSNorm and the rope of k_pe (interleaved or not), and rotates
  q's rope dims in place.
- `mla_attention`: absorbed attention. The caller folds W_UK into the query, q = [q_nope @ W_UK ‖ q_pe]
  [T, heads, R + P]; scores are q . entry over all R + P values, values are the latent part, and the output is
  the latent-space mix [T, heads, R] to which the caller applies W_UV. Decode rows run one program per (sequence,
  block of heads, KV split), flash-decoding style: 64 heads a program from 64 heads on (the M dim of Hopper's
  wgmma; per latent token 2 x 64 x (576 + 512) FLOPs for 1152 bytes, above the H200's ridge: compute-bound), else
  transposed with the keys as the M dim (16 heads: memory-bound); chunks of several queries run in tiles of
  BLOCK_Q tokens x BLOCK_H heads. An fp8 cache's tiles convert to fp16 in registers (q scaled once to fp16).
  A chunk longer than `max_absorbed_query_len` is skipped: its rows belong to the expanded path.
- `mla_expanded_attention`: the expanded path for long chunks: gather the sequences' latents, W_UK/W_UV
  expansion by one GEMM (kv_b_proj) into per-head K [L, heads, Dn + P] and V [L, heads, Dv], then the
  multi-head paged attention kernel of kernels/paged_attention.py over them (on CUDA in bf16/fp16, torch's
  FlashAttention varlen kernel over the contiguous K/V instead).

Per query-key pair and head the absorbed path costs 2 (R + P) + 2 R FLOPs (2176 for R = 512, P = 64), the
expanded one 2 (Dn + P) + 2 Dv (640, padded to 1024 in the paged kernel) plus the expansion, 2 R (Dn + Dv) per
key and head: expanding wins for chunks of more than a few hundred queries. EXPAND_CROSSOVER holds that crossover
as bench/mla_bench.py measured it on the H200. Semantics: reference.write_latent, reference.mla_attention,
reference.mla_expanded_attention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.fp8 import FP8_MAX_C, round_to_e4m3
from pagoda.kernels.paged_attention import (
    _F16_Q_AMAX,
    _LOG2E,
    _NEG_BIG,
    AttentionConfig,
    _find_seq,
    _split_reduce_kernel,
    _store_empty_split,
    _store_rows,
    check_batch_layout,
    grid_position,
    key_tile_range,
    online_softmax_step,
    paged_attention,
    softmax_sums_init,
    softmax_sums_total,
    softmax_tile,
    split_partials,
)
from pagoda.kernels.qkv_prep import _rotate, _to_cache
from pagoda.kernels.rope import _round_to, cos_sin_halves

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_LATENT_DIM = 1024
_MAX_ROPE_DIM = 256
_MAX_SPLITS = 32  # batch 1, 1k keys on an H200: 16 splits 12.1 us, 32 11.2, 64 19.5 (16 heads; 128: 16.6, 15.3, 35.9)
# Chunks of at least this many queries take the expanded path, by the attention heads on this rank: the crossover
# in device time with the host ahead, as a prefill forward runs (bench/mla_bench.py --quick --parts prefill, one
# H200, 2026-12-02, bf16 latents; bench/results/s12/call12b/mla_prefill.json). One chunk: 128 heads (V3) expanding
# wins from 256 queries at 0, 1024 and 4096 cached tokens; 16 heads (V2-Lite) from 1024, 512 and 16. The middle
# figure is kept (one threshold per launch: the kernel skips the expanded chunks by query length alone). A step's
# expanded chunks share one launch, which widens the gain: 32 prompts of 512 queries with 16 heads took 0.90 ms
# expanded against 2.64 ms absorbed. deepseek-v2-lite's reference workload (bench/mla_policy.py, same call): 14,020
# out tok/s at the earlier threshold of 2048 (host-launched timings, which measured the expanded path's ~0.7-1 ms
# of Python), 14,572 at 512, 14,620 at 128.
EXPAND_CROSSOVER = {16: 512, 128: 256}
EXPAND_MIN_QUERY_LEN = EXPAND_CROSSOVER[128]


def expand_min_query_len(num_heads: int) -> int:
    """The measured crossover of the nearest measured head count (on a log scale)."""
    nearest = min(EXPAND_CROSSOVER, key=lambda heads: abs(math.log2(heads) - math.log2(max(num_heads, 1))))
    return EXPAND_CROSSOVER[nearest]
# The expanded path materialises per-head K and V of every latent row it expands (rows x heads x 2 max(Dn + P, Dv)
# values): one launch holds at most this many bytes of them, and a sequence whose context would need more stays on
# the absorbed path, which needs no workspace. 1 GiB: 87k rows of DeepSeek-V2-Lite (16 heads), 10.9k of V3 (128).
EXPAND_WORKSPACE_BYTES = 1 << 30
EXPAND_MAX_ROWS = 32768  # the default bound when no head count is known


def expand_max_rows(num_heads: int, qk_head_dim: int, v_head_dim: int, itemsize: int,
                    workspace_bytes: int = EXPAND_WORKSPACE_BYTES) -> int:
    """Latent rows whose expanded K and V fit the workspace."""
    return max(1, workspace_bytes // (2 * num_heads * max(qk_head_dim, v_head_dim) * itemsize))


# A chunk of at least this many queries joins a step's expanded launch once another chunk has started it (a prompt
# split by the token budget, its rest against cached context): the launch's fixed cost is then paid, and what the
# chunk adds (its latent rows expanded, ~4 MFLOP each for 16 heads, 34 for 128) is less than the absorbed kernel
# spends on its query-key pairs from ~170 queries at equal efficiency (35 against 10 KFLOP a pair for 16 heads, 278
# against 82 for 128), fewer at the absorbed kernel's lower efficiency. H200, deepseek-v2-lite, 2026-12-04
# (bench/results/s27/mixed_steps.py): a 16,384-token step with one 448-query chunk and 64 decode rows beside 31
# expanded prompts took 159.8 ms of kernels against 151.0 for 32 expanded prompts.
EXPAND_JOIN_MIN_QUERY_LEN = 64


@dataclass(frozen=True, slots=True)
class ExpandPolicy:
    """Which chunks take the expanded path: at least min_query_len (>= 2) queries, in a sequence of at most
    max_seq_len tokens (its whole context is expanded at once; see expand_max_rows); once one does, every chunk of
    at least join_min_query_len queries within max_seq_len joins it (expanded_chunks)."""

    min_query_len: int = EXPAND_MIN_QUERY_LEN
    max_seq_len: int = EXPAND_MAX_ROWS
    join_min_query_len: int = EXPAND_JOIN_MIN_QUERY_LEN

    def expands(self, query_len: int, seq_len: int) -> bool:
        return query_len >= max(self.min_query_len, 2) and seq_len <= self.max_seq_len

    def joins(self, query_len: int, seq_len: int) -> bool:
        return query_len >= max(min(self.join_min_query_len, self.min_query_len), 2) and seq_len <= self.max_seq_len

    def expanded_chunks(self, query_lens: list[int], seq_lens: list[int]) -> list[int]:
        """The sequences whose chunks this step expands: those that expand on their own, and with them any that
        joins; none when no chunk expands on its own."""
        pairs = list(zip(query_lens, seq_lens, strict=True))
        if not any(self.expands(q, s) for q, s in pairs):
            return []
        return [b for b, (q, s) in enumerate(pairs) if self.joins(q, s)]


# --------------------------------------------------------------------------------------------- cache write


@triton.jit
def _write_latent_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, scale_ptr,
                         stride_ct, stride_pt, stride_cb, stride_cs,
                         LAT: tl.constexpr, LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """One program per token: cache[slot] = [kv_c ‖ k_pe] (fp8: / scale, clamped to +-448, rounded to e4m3)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (CUDA-graph batch filler): nothing to store
        return
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    offs_l = tl.arange(0, LAT_P)
    offs_r = tl.arange(0, ROPE_P)
    lat = tl.load(kv_c_ptr + token * stride_ct + offs_l, mask=offs_l < LAT)  # [LAT_P]
    rope = tl.load(k_pe_ptr + token * stride_pt + offs_r, mask=offs_r < ROPE)  # [ROPE_P]
    if FP8:
        scale = tl.load(scale_ptr)
        lat = round_to_e4m3(tl.clamp(tl.math.div_rn(lat.to(tl.float32), scale), -FP8_MAX_C, FP8_MAX_C))
        rope = round_to_e4m3(tl.clamp(tl.math.div_rn(rope.to(tl.float32), scale), -FP8_MAX_C, FP8_MAX_C))
    tl.store(row + offs_l, lat.to(cache_ptr.dtype.element_ty), mask=offs_l < LAT)
    tl.store(row + LAT + offs_r, rope.to(cache_ptr.dtype.element_ty), mask=offs_r < ROPE)


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Store kv_c [T, R] and k_pe [T, P] (strided row views fine, e.g. of the kv_a projection's output) as
    entries [R + P] of the latent cache [num_blocks, block_size, R + P] at flat slots (block * block_size +
    offset); slot -1 is padding and is skipped. An fp8 cache needs kv_scale [1] fp32 and stores x / kv_scale
    (as reference.write_latent). Slots must lie inside the cache (not checked: a device sync)."""
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(f"kv_c must be [T, R] and k_pe [T, P], got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    num_tokens, lat = kv_c.shape
    rope = k_pe.shape[1]
    if cache.dim() != 3 or cache.shape[2] != lat + rope or cache.stride(2) != 1:
        raise ValueError(f"cache must be [num_blocks, block_size, {lat + rope}] contiguous along its last dim, got "
                         f"{tuple(cache.shape)}")
    if not 0 < lat <= _MAX_LATENT_DIM or not 0 < rope <= _MAX_ROPE_DIM:
        raise ValueError(f"latent dim must be in 1..{_MAX_LATENT_DIM} and rope dim in 1..{_MAX_ROPE_DIM}, got "
                         f"{lat} and {rope}")
    if not kv_c.dtype.is_floating_point or k_pe.dtype != kv_c.dtype or cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_c and k_pe must share a float dtype and the cache be float, got {kv_c.dtype}, "
                         f"{k_pe.dtype}, {cache.dtype}")
    if kv_c.stride(1) != 1 or k_pe.stride(1) != 1:
        raise ValueError("kv_c and k_pe must be contiguous along their last dim")
    if (slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in _INDEX_DTYPES
            or not slot_mapping.is_contiguous()):
        raise ValueError(f"slot_mapping must be [T={num_tokens}] int32/int64 contiguous, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if not (kv_c.device == k_pe.device == cache.device == slot_mapping.device):
        raise ValueError("kv_c, k_pe, cache and slot_mapping must be on one device")
    fp8 = cache.dtype == torch.float8_e4m3fn
    _check_scale(kv_scale, fp8, cache.device)
    if num_tokens == 0:
        return
    _write_latent_kernel[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, kv_scale if fp8 else cache,
        kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        LAT=lat, LAT_P=triton.next_power_of_2(lat), ROPE=rope, ROPE_P=triton.next_power_of_2(rope),
        BLOCK_SIZE=cache.shape[1], FP8=fp8, num_warps=4)


def _check_scale(kv_scale: torch.Tensor | None, fp8: bool, device: torch.device) -> None:
    if fp8 and (kv_scale is None or kv_scale.shape != (1,) or kv_scale.dtype != torch.float32
                or kv_scale.device != device):
        raise ValueError("an fp8 latent cache needs kv_scale as a [1] fp32 tensor on its device")


@triton.jit
def _rope_pairs(x_ptr, offs_c, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two halves a rope rotates, as fp32: (x[2i], x[2i+1]) interleaved, else (x[i], x[i + HALF])."""
    if INTERLEAVED:
        x1 = tl.load(x_ptr + 2 * offs_c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + 2 * offs_c + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(x_ptr + offs_c, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF + offs_c, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _mla_prepare_kernel(q_ptr, kv_a_ptr, norm_ptr, cos_ptr, sin_ptr, positions_ptr, cache_ptr, slot_mapping_ptr,
                        scale_ptr, eps, stride_qt, stride_qh, stride_at, stride_cos, stride_sin, stride_cb, stride_cs,
                        NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, ROPE_OFFSET: tl.constexpr,
                        LAT: tl.constexpr, LAT_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (tokens, 2): program (t, 0) rotates token t's q rope dims in place (all heads); (t, 1) stores its cache
    entry [rms_norm(c_kv) ‖ rope(k_pe)]. Roundings as reference.mla_prepare, step by step in q's dtype."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    CACHE_DTYPE: tl.constexpr = cache_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(positions_ptr + token).to(tl.int64)
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HALF, HALF_P)  # [HALF_P] each
    offs_c = tl.arange(0, HALF_P)
    c_mask = offs_c < HALF
    if tl.program_id(1) == 0:
        offs_h = tl.arange(0, HEADS_P)
        mask = (offs_h < NUM_HEADS)[:, None] & c_mask[None, :]  # [HEADS_P, HALF_P]
        head_rows = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + ROPE_OFFSET
        x1, x2 = _rope_pairs(head_rows, offs_c[None, :], mask, HALF, INTERLEAVED)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, DTYPE)
        tl.store(head_rows + offs_c[None, :], o1.to(DTYPE), mask=mask)  # rotate-half order
        tl.store(head_rows + HALF + offs_c[None, :], o2.to(DTYPE), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # else a padding token: nothing to store
            a_row = kv_a_ptr + token * stride_at
            offs_l = tl.arange(0, LAT_P)
            l_mask = offs_l < LAT
            lat = tl.load(a_row + offs_l, mask=l_mask, other=0.0).to(tl.float32)  # [LAT_P]
            rstd = tl.rsqrt(tl.sum(lat * lat, 0) / LAT + eps)
            weight = tl.load(norm_ptr + offs_l, mask=l_mask, other=0.0).to(tl.float32)
            lat = _round_to(_round_to(lat * rstd, DTYPE) * weight, DTYPE)
            x1, x2 = _rope_pairs(a_row + LAT, offs_c, c_mask, HALF, INTERLEAVED)  # [HALF_P] each
            o1, o2 = _rotate(x1[None, :], x2[None, :], c1, c2, s1, s2, DTYPE)  # [1, HALF_P] each
            entry = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            tl.store(entry + offs_l, _to_cache(lat, scale_ptr, CACHE_DTYPE, FP8), mask=l_mask)
            tl.store(entry + LAT + offs_c[None, :], _to_cache(o1, scale_ptr, CACHE_DTYPE, FP8), mask=c_mask[None, :])
            tl.store(entry + LAT + HALF + offs_c[None, :], _to_cache(o2, scale_ptr, CACHE_DTYPE, FP8),
                     mask=c_mask[None, :])


def mla_prepare(q: torch.Tensor, kv_a: torch.Tensor, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                kv_scale: torch.Tensor | None = None, interleaved: bool = False) -> None:
    """One launch for an MLA layer's attention inputs (reference.mla_prepare): q [T, heads, Dn + P] (a strided
    view is fine) gets its last P dims rotated in place; kv_a [T, R + P] (the kv_a projection's rows) becomes the
    cache entries [rms_norm(c_kv, kv_norm) ‖ rope(k_pe)] at slot_mapping (-1: skipped). cos/sin [max_pos, P] are
    indexed by positions [T] (< max_pos, not checked). interleaved: DeepSeek's pairwise rope layout, rotated
    into rotate-half order. An fp8 cache needs kv_scale [1] fp32."""
    if q.dim() != 3 or kv_a.dim() != 2 or q.shape[0] != kv_a.shape[0]:
        raise ValueError(f"q must be [T, heads, Dn + P] and kv_a [T, R + P], got {tuple(q.shape)} and "
                         f"{tuple(kv_a.shape)}")
    num_tokens, num_heads, qk_dim = q.shape
    lat = kv_norm.shape[0]
    rope = kv_a.shape[1] - lat
    if kv_norm.dim() != 1 or rope <= 0 or rope % 2 or rope > qk_dim or rope > _MAX_ROPE_DIM or lat > _MAX_LATENT_DIM:
        raise ValueError(f"kv_norm [R] must leave an even rope part of kv_a {tuple(kv_a.shape)} that fits q's "
                         f"{qk_dim} dims, got R = {lat}")
    if cache.dim() != 3 or cache.shape[2] != lat + rope or cache.stride(2) != 1 or cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"cache must be [num_blocks, block_size, {lat + rope}] float, contiguous rows, got "
                         f"{tuple(cache.shape)} {cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or kv_a.dtype != q.dtype or \
            kv_norm.dtype != q.dtype:
        raise ValueError(f"q, kv_a and kv_norm must share a float dtype, got {q.dtype}, {kv_a.dtype}, {kv_norm.dtype}")
    if q.stride(2) != 1 or kv_a.stride(1) != 1 or not kv_norm.is_contiguous():
        raise ValueError("q, kv_a and kv_norm must be contiguous along their last dim")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != rope or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos and sin must both be [positions, {rope}] with contiguous rows")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (num_tokens,) or index.dtype not in _INDEX_DTYPES or not index.is_contiguous():
            raise ValueError(f"{name} must be [T={num_tokens}] int32/int64 contiguous, got {tuple(index.shape)}")
    if not all(t.device == q.device for t in (kv_a, kv_norm, cos, sin, positions, cache, slot_mapping)):
        raise ValueError(f"all tensors must be on q's device {q.device}")
    fp8 = cache.dtype == torch.float8_e4m3fn
    _check_scale(kv_scale, fp8, q.device)
    if num_tokens == 0:
        return
    half = rope // 2
    pdl_options = pdl.launch_options(q.device)
    _mla_prepare_kernel[(num_tokens, 2)](
        q, kv_a, kv_norm, cos, sin, positions, cache, slot_mapping, kv_scale if fp8 else cos, eps,
        q.stride(0), q.stride(1), kv_a.stride(0), cos.stride(0), sin.stride(0), cache.stride(0), cache.stride(1),
        NUM_HEADS=num_heads, HEADS_P=triton.next_power_of_2(num_heads), ROPE_OFFSET=qk_dim - rope, LAT=lat,
        LAT_P=triton.next_power_of_2(lat), HALF=half, HALF_P=triton.next_power_of_2(half),
        BLOCK_SIZE=cache.shape[1], INTERLEAVED=interleaved, FP8=fp8, num_warps=4,
        **pdl_options)


# ------------------------------------------------------------------------------------ absorbed attention


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Launch shapes of one mla_attention call (host-side only, so a batch size keeps one shape under CUDA
    graphs). A program holds BLOCK_H query heads of one sequence: decode rows are those heads (the M dim of
    tl.dot, padded to >= 16), or with decode_keys_m the N dim while the keys are M; chunk tiles are
    prefill_block_m rows = prefill_block_m // BLOCK_H tokens x BLOCK_H heads. A latent tile is loaded once (to
    shared memory) and feeds both the score dot (all R + P dims) and the value dot (its first R)."""

    num_splits: int = 1  # KV splits per program (flash decoding); 1 = no reduce kernel
    block_h: int = 16  # query heads per program (power of two)
    decode_tile_n: int = 32  # keys per inner-loop step (power of two >= 16)
    decode_num_warps: int = 8  # 4 spill registers at 16 heads x 32 keys (ptxas for sm_90: 255 + 128 B of stack)
    decode_num_stages: int = 2
    decode_keys_m: bool = False  # decode dots transposed (keys = M): wgmma on Hopper for block_h < 64
    decode_lazy_sum: bool = False  # decode softmax sums per key slot, summed once after the tiles (as paged attention)
    prefill_block_m: int = 32  # rows of a chunk tile (power of two >= 16 and >= block_h)
    prefill_tile_n: int = 32
    prefill_num_warps: int = 8  # a [32, 512] fp32 accumulator: 64 registers a thread with 8 warps
    prefill_num_stages: int = 2
    heads_fast: bool = True  # grid axis 0 = head block: a sequence's head blocks run side by side (L2 reuse)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_mla_splits(num_seqs: int, num_head_blocks: int, max_query_len: int, max_seq_len: int,
                    num_sms: int = 132) -> int:
    """Split-KV only for decode batches whose (sequence, head block) programs do not fill the GPU: aim for ~2
    programs per SM, at least one 64-key tile per split. Host ints only (under CUDA graphs pass max_seq_len =
    max_model_len so a batch size keeps its choice); a power of two, at most 16."""
    if max_query_len > 1:
        return 1
    base = max(num_seqs * num_head_blocks, 1)
    if base >= num_sms:
        return 1
    splits = max(1, min(_MAX_SPLITS, -(-2 * num_sms // base), max_seq_len // 64))
    return 1 << (splits.bit_length() - 1)


# Heads per program from which decode runs query heads as the M dim of the dots: 64 rows per warp group is what
# Hopper's wgmma takes, and the latent tile is then read once per 64 heads (V3's 128 heads: twice per sequence,
# the second time mostly from L2 as a sequence's head blocks run side by side).
WIDE_BLOCK_H = 64


@functools.lru_cache(maxsize=256)
def pick_mla_config(num_seqs: int, num_heads: int, max_query_len: int, max_seq_len: int,
                    num_sms: int = 132, legacy: bool = False, fp8: bool = False) -> MLAConfig:
    """Default launch shapes, chosen from what ptxas reports for sm_90 (no spills in the bf16 decode loop;
    bench/mla_bench.py --sweep times the alternatives on the target GPU): >= 64 heads: 64-head programs, 32-key
    tiles, 8 warps (a [64, 512] fp32 accumulator over two warp groups); fewer heads: decode transposed (keys as the
    M dim, so wgmma runs with 16 heads), 32-key tiles, 4 warps, 3 stages. Split-KV for small decode batches.
    Decode batches that fill the GPU without splits take the H200 sweep's winners (bench/mla_bench.py --sweep,
    B=256, 1k keys, 2026-12-02): 128 heads 64-key tiles, 2 stages (303 us against 439 bf16, 501 against 792 fp8);
    16 heads bf16 untransposed 32-key tiles, 4 warps, 2 stages (94.9 us = 0.76 of HBM, against 127.7), fp8 the
    transposed shape with 2 stages (126.8 against 131.5). Fewer than 64 heads: the decode softmax sums per key slot
    (decode_lazy_sum; sm_90 SASS, 16 heads: bf16 loop 427 -> 412 instructions, 9 -> 6 barriers; fp8 1169 -> 1122,
    10 -> 7; H200 2026-12-04, mla_bench --parts lazy: B=64 split-KV 42.1 / 119.5 us against 44.9 / 132.1 at 1k / 4k
    keys, fp8 B=256 127.3 / 474.4 against 133.0 / 495.9, bf16 B=256 level); not for 64-head programs, which already
    run 2 barriers a tile and spill more with it (fp8 B=256 548 against 498 us). fp8: the cache is e4m3.
    legacy: the 16-heads-per-program shape of the first version (for comparisons)."""
    if legacy:
        block_h = min(16, triton.next_power_of_2(num_heads))
        return MLAConfig(num_splits=pick_mla_splits(num_seqs, -(-num_heads // block_h), max_query_len, max_seq_len,
                                                    num_sms), block_h=block_h, heads_fast=max_query_len <= 1)
    if num_heads >= WIDE_BLOCK_H:
        splits = pick_mla_splits(num_seqs, -(-num_heads // WIDE_BLOCK_H), max_query_len, max_seq_len, num_sms)
        full = splits == 1 and max_query_len <= 1
        return MLAConfig(num_splits=splits, block_h=WIDE_BLOCK_H, decode_tile_n=64 if full else 32,
                         decode_num_warps=8, decode_num_stages=2 if full else 3, prefill_block_m=WIDE_BLOCK_H,
                         prefill_tile_n=32, prefill_num_warps=8, prefill_num_stages=2, heads_fast=max_query_len <= 1)
    block_h = min(16, triton.next_power_of_2(num_heads))
    splits = pick_mla_splits(num_seqs, -(-num_heads // block_h), max_query_len, max_seq_len, num_sms)
    full = splits == 1 and max_query_len <= 1
    return MLAConfig(num_splits=splits, block_h=block_h, decode_tile_n=32, decode_num_warps=4,
                     decode_num_stages=2 if full else 3, decode_keys_m=fp8 or not full, decode_lazy_sum=True,
                     heads_fast=max_query_len <= 1)


@triton.jit
def _load_latent_tile(cache_ptr, block_table_row, stride_cb, stride_cs, kv_end, j,
                      LAT: tl.constexpr, LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, F16_DOTS: tl.constexpr,
                      DTYPE: tl.constexpr):
    """Key tile j: (key positions [TILE_N], latents [TILE_N, LAT_P], rope keys [TILE_N, ROPE_P]) in the dot dtype.
    MASKED: keys >= kv_end (and padded dims) read as 0. An fp8 tile converts to fp16 with F16_DOTS (one cvt per
    pair; bf16 would take three), else to DTYPE; the scale is applied by the caller."""
    offs_n = tl.arange(0, TILE_N)
    offs_l = tl.arange(0, LAT_P)
    offs_r = tl.arange(0, ROPE_P)
    key = j * TILE_N + offs_n  # [TILE_N] absolute key positions
    if MASKED:
        key_mask = key < kv_end
        block = tl.load(block_table_row + key // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    else:
        key_mask = offs_n < TILE_N
        block = tl.load(block_table_row + key // BLOCK_SIZE).to(tl.int64)  # [TILE_N]
    row = cache_ptr + block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs  # [TILE_N, 1]
    if MASKED or LAT != LAT_P:
        lat = tl.load(row + offs_l[None, :], mask=key_mask[:, None] & (offs_l < LAT)[None, :], other=0.0)
    else:
        lat = tl.load(row + offs_l[None, :])  # [TILE_N, LAT_P]
    if MASKED or ROPE != ROPE_P:
        rope = tl.load(row + LAT + offs_r[None, :], mask=key_mask[:, None] & (offs_r < ROPE)[None, :], other=0.0)
    else:
        rope = tl.load(row + LAT + offs_r[None, :])  # [TILE_N, ROPE_P]
    if F16_DOTS:
        lat = lat.to(tl.float16)
        rope = rope.to(tl.float16)
    else:
        lat = lat.to(DTYPE)
        rope = rope.to(DTYPE)
    return key, lat, rope


@triton.jit
def _attend_latent_tiles(acc, l_i, m_i, q_lat, q_rope, cache_ptr, block_table_row, stride_cb, stride_cs,
                         qk_scale, row_pos, kv_end, tile_lo, tile_hi,
                         LAT: tl.constexpr, LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, LAZY_SUM: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi), query rows as the M dim of the dots: scores
    q_lat . lat + q_rope . rope [BLOCK_M, TILE_N], values lat; the tile is loaded once and used by both dots.
    MASKED=False tiles lie wholly below every row's causal limit (no key, causal or table masks). LAZY_SUM: l_i is
    [BLOCK_M, TILE_N], per key slot, summed by the caller after the last tile."""
    for j in range(tile_lo, tile_hi):
        key, lat, rope = _load_latent_tile(cache_ptr, block_table_row, stride_cb, stride_cs, kv_end, j, LAT, LAT_P,
                                           ROPE, ROPE_P, BLOCK_SIZE, TILE_N, MASKED, F16_DOTS, q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
        s = tl.dot(q_rope, tl.trans(rope), s, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(key[None, :] <= row_pos[:, None], s, float("-inf"))
        if LAZY_SUM:
            p, alpha, m_new = softmax_tile(s, m_i, 1)  # p [BLOCK_M, TILE_N]
            l_i = l_i * alpha[:, None] + p  # [BLOCK_M, TILE_N]
        else:
            p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i, 1)  # p [BLOCK_M, TILE_N]
        acc = tl.dot(p.to(lat.dtype), lat, acc * alpha[:, None], input_precision=DOT_PRECISION)  # [BLOCK_M, LAT_P]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_latent_tiles_keys_m(acc_t, l_i, m_i, q_lat_t, q_rope_t, cache_ptr, block_table_row, stride_cb,
                                stride_cs, qk_scale, kv_end, tile_lo, tile_hi,
                                LAT: tl.constexpr, LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                                BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                                DOT_PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, LAZY_SUM: tl.constexpr):
    """The same for one decode query per head, transposed so that keys are the M dim of the dots (few heads would
    pad M to 16 and miss Hopper's wgmma, which needs M = 64 per warp group): scores^T [TILE_N, BLOCK_M] =
    lat @ q_lat^T + rope @ q_rope^T, acc^T [LAT_P, BLOCK_M] += lat^T @ p^T. Every row attends keys < kv_end."""
    for j in range(tile_lo, tile_hi):
        key, lat, rope = _load_latent_tile(cache_ptr, block_table_row, stride_cb, stride_cs, kv_end, j, LAT, LAT_P,
                                           ROPE, ROPE_P, BLOCK_SIZE, TILE_N, MASKED, F16_DOTS, q_lat_t.dtype)
        s = tl.dot(lat, q_lat_t, input_precision=DOT_PRECISION)  # [TILE_N, BLOCK_M]
        s = tl.dot(rope, q_rope_t, s, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where((key < kv_end)[:, None], s, float("-inf"))
        if LAZY_SUM:  # l_i [TILE_N, BLOCK_M], per key slot
            p, alpha, m_new = softmax_tile(s, m_i, 0)  # p [TILE_N, BLOCK_M]
            l_i = l_i * alpha[None, :] + p
        else:
            p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i, 0)  # p [TILE_N, BLOCK_M]
        acc_t = tl.dot(tl.trans(lat), p.to(lat.dtype), acc_t * alpha[None, :],
                       input_precision=DOT_PRECISION)  # [LAT_P, BLOCK_M]
        m_i = m_new
    return acc_t, l_i, m_i


@triton.jit
def _zero_tail(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, num_seqs, num_tokens,
               head_block, split, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_M: tl.constexpr, LAT: tl.constexpr, LAT_P: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Rows [qsl[B], T) (CUDA-graph padding) of this head block come out zero, BLOCK_M // BLOCK_H at a time."""
    offs_m = tl.arange(0, BLOCK_M)
    zero_acc = tl.zeros([BLOCK_M, LAT_P], tl.float32)
    zero_sum = tl.zeros([BLOCK_M], tl.float32)
    empty_max = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    row_head = head_block * BLOCK_H + offs_m % BLOCK_H
    for first in range(tl.load(query_start_loc_ptr + num_seqs), num_tokens, BLOCK_M // BLOCK_H):
        token = first + offs_m // BLOCK_H
        valid = (offs_m < (BLOCK_M // BLOCK_H) * BLOCK_H) & (token < num_tokens) & (row_head < NUM_HEADS)
        _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, zero_acc, zero_sum, empty_max,
                    token.to(tl.int64), row_head, valid, split, stride_ot, stride_oh, NUM_HEADS, LAT, LAT_P,
                    NUM_SPLITS)


# num_seqs, num_tokens and the block table's width change from step to step: left
# unspecialised so that they compile no new variant while serving.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def _mla_kernel(out_ptr, q_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                part_out_ptr, part_max_ptr, part_sum_ptr, kv_scale_ptr,
                qk_scale, num_seqs, num_tokens,
                stride_qt, stride_qh, stride_rt, stride_rh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
                NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LAT: tl.constexpr, LAT_P: tl.constexpr,
                ROPE: tl.constexpr, ROPE_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr,
                DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr, F16_DOTS: tl.constexpr,
                HEADS_FAST: tl.constexpr, KEYS_M: tl.constexpr, USE_PDL: tl.constexpr,
                LAZY_SUM: tl.constexpr = False):
    """One program: BLOCK_Q query tokens x BLOCK_H heads (row m = token m // BLOCK_H, head m % BLOCK_H of the
    head block) over one split of the keys. Grid: (programs along the queries, head blocks, splits), the first
    two swapped with HEADS_FAST. DECODE: program b is sequence b and runs only if its query length is 1;
    program num_seqs, if launched, zeroes the padding rows past the last sequence. Else: program i is the i-th
    query tile of the flattened batch (binary search); length-1 sequences are left to a DECODE launch. Chunks
    that the expanded path computes never reach it: the model hands it only the absorbed rows, as a sub-batch."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    pid, head_block, num_q_programs, split = grid_position(HEADS_FAST)
    offs_m = tl.arange(0, BLOCK_M)

    if DECODE:
        b = pid
        if b == num_seqs:
            _zero_tail(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, num_seqs,
                       num_tokens, head_block, split, stride_ot, stride_oh, NUM_HEADS, BLOCK_H, BLOCK_M, LAT,
                       LAT_P, NUM_SPLITS)
            return
        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
        if q_len != 1:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        q_lo = 0
    else:
        pid = num_q_programs - 1 - pid  # last (longest-attending) tiles first
        b = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
        is_seq = b < num_seqs  # else: the padding tail past the last sequence, which attends nothing
        q_start = tl.load(query_start_loc_ptr + b)
        q_end = tl.where(is_seq, tl.load(query_start_loc_ptr + b + 1, mask=is_seq, other=0), num_tokens)
        seq_len = tl.load(seq_lens_ptr + b, mask=is_seq, other=0)
        q_lo = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
        q_len = q_end - q_start
        if q_lo >= q_len:
            return
        if is_seq & (q_len == 1):  # decode rows: the decode programs' (a launch of their own)
            return
    context_len = seq_len - q_len  # cached tokens before this chunk; < 0 only for padding rows

    row_q = q_lo + offs_m // BLOCK_H  # [BLOCK_M] query index within the sequence
    row_head = head_block * BLOCK_H + offs_m % BLOCK_H  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * BLOCK_H) & (row_q < q_len) & (row_head < NUM_HEADS)
    row_token = (q_start + row_q).to(tl.int64)
    row_pos = context_len + row_q  # [BLOCK_M] absolute position: attends keys 0..row_pos
    kv_end, num_full, tile_lo, tile_hi = key_tile_range(context_len, q_lo, q_len, split, BLOCK_Q, TILE_N, NUM_SPLITS)
    if NUM_SPLITS > 1:
        if tile_lo >= tile_hi:  # no key for this split: (max, sum) only, the reduce skips its output
            _store_empty_split(part_max_ptr, part_sum_ptr, row_token, row_head, row_valid, split, NUM_HEADS,
                               NUM_SPLITS)
            return
    if FP8_KV:  # scores = q . (entry_fp8 * scale): the per-tensor scale folds into the softmax scale
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    block_table_row = block_tables_ptr + b.to(tl.int64) * stride_bt  # never read for the padding tail
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = softmax_sums_init(LAZY_SUM, KEYS_M, TILE_N, BLOCK_M)
    offs_l = tl.arange(0, LAT_P)
    offs_r = tl.arange(0, ROPE_P)
    if KEYS_M:  # decode with few heads: q loaded transposed, keys are the M dim (_attend_latent_tiles_keys_m)
        q_col = q_ptr + row_token[None, :] * stride_qt + row_head[None, :] * stride_qh  # [1, BLOCK_M]
        q_rope_col = q_rope_ptr + row_token[None, :] * stride_rt + row_head[None, :] * stride_rh  # [1, BLOCK_M]
        q_lat = tl.load(q_col + offs_l[:, None], mask=row_valid[None, :] & (offs_l < LAT)[:, None],
                        other=0.0)  # [LAT_P, BLOCK_M]
        q_rope = tl.load(q_rope_col + offs_r[:, None], mask=row_valid[None, :] & (offs_r < ROPE)[:, None],
                         other=0.0)  # [ROPE_P, BLOCK_M]
        if F16_DOTS:
            q_lat, q_rope, qk_scale = _scale_q_to_f16(q_lat, q_rope, qk_scale)
        acc_t = tl.zeros([LAT_P, BLOCK_M], tl.float32)
        acc_t, l_i, m_i = _attend_latent_tiles_keys_m(
            acc_t, l_i, m_i, q_lat, q_rope, cache_ptr, block_table_row, stride_cb, stride_cs, qk_scale, kv_end,
            tile_lo, tl.minimum(tile_hi, num_full), LAT, LAT_P, ROPE, ROPE_P, BLOCK_SIZE, TILE_N, False,
            DOT_PRECISION, F16_DOTS, LAZY_SUM)
        acc_t, l_i, m_i = _attend_latent_tiles_keys_m(
            acc_t, l_i, m_i, q_lat, q_rope, cache_ptr, block_table_row, stride_cb, stride_cs, qk_scale, kv_end,
            tl.maximum(tile_lo, num_full), tile_hi, LAT, LAT_P, ROPE, ROPE_P, BLOCK_SIZE, TILE_N, True,
            DOT_PRECISION, F16_DOTS, LAZY_SUM)
        acc = tl.trans(acc_t)  # [BLOCK_M, LAT_P]
    else:
        q_row = q_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh  # [BLOCK_M, 1]
        q_rope_row = q_rope_ptr + row_token[:, None] * stride_rt + row_head[:, None] * stride_rh  # [BLOCK_M, 1]
        q_lat = tl.load(q_row + offs_l[None, :], mask=row_valid[:, None] & (offs_l < LAT)[None, :],
                        other=0.0)  # [BLOCK_M, LAT_P]
        q_rope = tl.load(q_rope_row + offs_r[None, :], mask=row_valid[:, None] & (offs_r < ROPE)[None, :],
                         other=0.0)  # [BLOCK_M, ROPE_P]
        if F16_DOTS:
            q_lat, q_rope, qk_scale = _scale_q_to_f16(q_lat, q_rope, qk_scale)
        acc = tl.zeros([BLOCK_M, LAT_P], tl.float32)
        acc, l_i, m_i = _attend_latent_tiles(acc, l_i, m_i, q_lat, q_rope, cache_ptr, block_table_row, stride_cb,
                                             stride_cs, qk_scale, row_pos, kv_end, tile_lo,
                                             tl.minimum(tile_hi, num_full), LAT, LAT_P, ROPE, ROPE_P, BLOCK_SIZE,
                                             TILE_N, False, DOT_PRECISION, F16_DOTS, LAZY_SUM)
        acc, l_i, m_i = _attend_latent_tiles(acc, l_i, m_i, q_lat, q_rope, cache_ptr, block_table_row, stride_cb,
                                             stride_cs, qk_scale, row_pos, kv_end, tl.maximum(tile_lo, num_full),
                                             tile_hi, LAT, LAT_P, ROPE, ROPE_P, BLOCK_SIZE, TILE_N, True,
                                             DOT_PRECISION, F16_DOTS, LAZY_SUM)
    l_i = softmax_sums_total(l_i, LAZY_SUM, KEYS_M)  # [BLOCK_M]
    if FP8_KV:  # values are the fp8 latents: sum_j p_j (lat_j * scale) = scale * sum_j p_j lat_j
        acc = acc * tl.load(kv_scale_ptr)
    _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, acc, l_i, m_i, row_token, row_head, row_valid,
                split, stride_ot, stride_oh, NUM_HEADS, LAT, LAT_P, NUM_SPLITS)


@triton.jit
def _scale_q_to_f16(q_lat, q_rope, qk_scale):
    """fp16 dots over an fp8 cache: q scaled once so its amax is _F16_Q_AMAX (products exact in fp32, far from
    fp16 overflow), the inverse folded into the softmax scale. Returns (q_lat, q_rope, qk_scale)."""
    lat32 = q_lat.to(tl.float32)
    rope32 = q_rope.to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(lat32), 1), 0), tl.max(tl.max(tl.abs(rope32), 1), 0))
    q_mult = _F16_Q_AMAX / tl.maximum(amax, 1.0e-30)
    return (lat32 * q_mult).to(tl.float16), (rope32 * q_mult).to(tl.float16), qk_scale / q_mult


def _check_split_q(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_lora_rank: int) -> None:
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2] or q_lat.shape[2] != kv_lora_rank:
        raise ValueError(f"with q_rope, q must be [T, heads, {kv_lora_rank}] and q_rope [T, heads, P], got "
                         f"{tuple(q_lat.shape)} and {tuple(q_rope.shape)}")
    if q_rope.dtype != q_lat.dtype or q_rope.device != q_lat.device or q_rope.stride(2) != 1:
        raise ValueError("q_rope must have q's dtype and device and be contiguous along its last dim")


def _check_attention_inputs(q_shape: tuple[int, ...], q: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            kv_lora_rank: int) -> None:
    """ValueError on anything the kernel relies on; messages are built only on failure (this runs every layer).
    q_shape: the whole query's [T, heads, R + P] (q may hold its first R values only)."""
    if len(q_shape) != 3 or cache.dim() != 3 or q_shape[2] != cache.shape[2]:
        raise ValueError(f"q must be [T, heads, R + P] and the cache [num_blocks, block_size, R + P], got "
                         f"{tuple(q_shape)} and {tuple(cache.shape)}")
    width = q_shape[2]
    if not 0 < kv_lora_rank < width or kv_lora_rank > _MAX_LATENT_DIM or width - kv_lora_rank > _MAX_ROPE_DIM:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must split entries of {width} into a latent of at most "
                         f"{_MAX_LATENT_DIM} and a rope part of 1..{_MAX_ROPE_DIM}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} is not a float type")
    if cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"the cache must have q's dtype {q.dtype} or be float8_e4m3fn, got {cache.dtype}")
    if q.stride(2) != 1 or cache.stride(2) != 1:
        raise ValueError("q and the cache must be contiguous along their last dim")
    check_batch_layout(block_tables, seq_lens, query_start_loc)
    if not (cache.device == q.device == block_tables.device == seq_lens.device == query_start_loc.device):
        raise ValueError(f"all tensors must be on q's device {q.device}")


def _check_config(config: MLAConfig) -> None:
    for name in ("decode_tile_n", "prefill_block_m", "prefill_tile_n"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if config.block_h < 1 or config.block_h & (config.block_h - 1) or config.block_h > config.prefill_block_m:
        raise ValueError(f"block_h must be a power of two <= prefill_block_m, got {config.block_h}")
    if not 1 <= config.num_splits <= 64:
        raise ValueError(f"num_splits must be in 1..64, got {config.num_splits}")


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float,
                  kv_lora_rank: int, out: torch.Tensor | None = None, config: MLAConfig | None = None,
                  kv_scale: torch.Tensor | None = None, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed causal attention of q [T, heads, R + P] (R = kv_lora_rank) over the latent cache [num_blocks,
    block_size, R + P]; semantics of reference.mla_attention. Returns out [T, heads, R] (q's dtype): per row the
    softmax(scale * q . entries) mix of the entries' latent parts. Sequence b's queries are rows [qsl[b],
    qsl[b+1]), the last ones of its seq_lens[b] tokens, whose entries are already cached. Rows past qsl[B]
    (padding) and of sequences with seq_lens[b] == 0 come out zero. An fp8 cache needs kv_scale [1] fp32. Not checked
    (a device sync): qsl non-decreasing with qsl[B] <= T, seq_lens[b] >= query length, block_tables covering
    seq_lens. max_query_len and max_seq_len are upper bounds that pick the launch shape only. q_rope: q's rope part
    as a tensor of its own ([T, heads, P], any row strides); q is then [T, heads, R] (e.g. the W_UK product's
    transposed view): the two halves need not be concatenated."""
    if q_rope is not None:
        _check_split_q(q, q_rope, kv_lora_rank)
        q_full_shape = (*q.shape[:2], q.shape[2] + q_rope.shape[2])
    else:
        q_full_shape = tuple(q.shape)
    _check_attention_inputs(q_full_shape, q, cache, block_tables, seq_lens, query_start_loc, kv_lora_rank)
    if q_rope is None:
        q, q_rope = q[..., :kv_lora_rank], q[..., kv_lora_rank:]  # views: the kernel reads the halves apart
    fp8 = cache.dtype == torch.float8_e4m3fn
    _check_scale(kv_scale, fp8, q.device)
    num_tokens, num_heads, lat = q.shape
    rope = q_rope.shape[2]
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, lat), dtype=q.dtype, device=q.device)  # [T, heads, R]
    elif out.shape != (num_tokens, num_heads, lat) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {(num_tokens, num_heads, lat)} {q.dtype} contiguous along its last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0:
        return out
    if config is None:
        num_sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
        config = pick_mla_config(num_seqs, num_heads, max_query_len, max_seq_len, num_sms, fp8=fp8)
    else:
        _check_config(config)
    lat_p, rope_p = max(16, triton.next_power_of_2(lat)), max(16, triton.next_power_of_2(rope))
    block_h = min(config.block_h, triton.next_power_of_2(num_heads))
    num_head_blocks = -(-num_heads // block_h)
    num_splits = config.num_splits
    part_out, part_max, part_sum = split_partials(out, num_tokens, num_heads, num_splits, lat_p)
    args = (out, q, q_rope, cache, block_tables, seq_lens, query_start_loc, part_out, part_max, part_sum,
            kv_scale if fp8 else out, scale * _LOG2E, num_seqs, num_tokens,
            q.stride(0), q.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
            cache.stride(0), cache.stride(1),
            block_tables.stride(0))
    shape = dict(NUM_HEADS=num_heads, BLOCK_H=block_h, LAT=lat, LAT_P=lat_p, ROPE=rope, ROPE_P=rope_p,
                 BLOCK_SIZE=cache.shape[1], NUM_SPLITS=num_splits,
                 DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_KV=fp8,
                 F16_DOTS=fp8 and q.dtype != torch.float32, HEADS_FAST=config.heads_fast)

    pdl_options = pdl.launch_options(q.device)

    def grid(num_q_programs: int) -> tuple[int, int, int]:
        if config.heads_fast:
            return (num_head_blocks, num_q_programs, num_splits)
        return (num_q_programs, num_head_blocks, num_splits)

    decode_only = max_query_len <= 1
    num_decode_programs = num_seqs + 1 if decode_only else num_seqs  # + 1: zero the padding tail
    if num_decode_programs:
        _mla_kernel[grid(num_decode_programs)](
            *args, **shape, BLOCK_Q=1, BLOCK_M=max(16, block_h), TILE_N=config.decode_tile_n, DECODE=True,
            KEYS_M=config.decode_keys_m, LAZY_SUM=config.decode_lazy_sum, num_warps=config.decode_num_warps,
            num_stages=config.decode_num_stages,
            **pdl_options)
    if not decode_only:
        block_m = max(config.prefill_block_m, block_h)
        block_q = block_m // block_h
        num_q_tiles = num_tokens // block_q + num_seqs + 1  # bounds every sequence's tiles plus the padding tail
        _mla_kernel[grid(num_q_tiles)](
            *args, **shape, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=config.prefill_tile_n, DECODE=False,
            KEYS_M=False, num_warps=config.prefill_num_warps, num_stages=config.prefill_num_stages,
            **pdl_options)
    if num_splits > 1:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_max, part_sum, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=lat,
            HEAD_DIM_P=lat_p, NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits), num_warps=4,
            **pdl_options)
    return out


# ------------------------------------------------------------------------------------ expanded attention


def to_device_async(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host integers -> a tensor on `device` without a stream sync: through page-locked memory on CUDA (a copy
    from pageable memory waits for the stream to drain, which inside a prefill forward stalls every later launch)."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def gather_latent_rows(cache: torch.Tensor, block_tables: torch.Tensor, seqs: list[int], seq_lens: list[int],
                       dtype: torch.dtype, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The cached entries of positions 0..seq_lens[b]-1 of each sequence b in seqs, one after another:
    [sum of those lengths, R + P] in dtype (an fp8 cache dequantized with kv_scale). Indices are built on the
    device from host lengths (no sync)."""
    device = cache.device
    lens = [seq_lens[b] for b in seqs]
    total = sum(lens)
    width = cache.shape[2]
    if total == 0:
        return torch.empty((0, width), dtype=dtype, device=device)
    block_size = cache.shape[1]
    lens_t = to_device_async(np.asarray(lens, dtype=np.int64), device)  # [S]
    offsets = torch.cumsum(lens_t, 0) - lens_t  # [S] first gathered row of each sequence
    seq_of_row = torch.repeat_interleave(torch.arange(len(seqs), device=device), lens_t, output_size=total)  # [L]
    pos = torch.arange(total, device=device) - offsets[seq_of_row]  # [L] position within its sequence
    seq_ids = to_device_async(np.asarray(seqs, dtype=np.int64), device)[seq_of_row]  # [L]
    blocks = block_tables[seq_ids, pos // block_size].long()  # [L]
    rows = cache.view(-1, width).index_select(0, blocks * block_size + pos % block_size)  # [L, R + P]
    if cache.dtype == torch.float8_e4m3fn:
        assert kv_scale is not None
        return (rows.float() * kv_scale).to(dtype)
    return rows.to(dtype)


def expand_latent(latent: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                  v_head_dim: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [L, R + P] -> per-head K [L, heads, head_dim] = [k_nope ‖ k_pe ‖ 0] and V [L, heads, head_dim] =
    [v ‖ 0], with [k_nope ‖ v] = c_kv @ w_kv_b^T per head (w_kv_b [heads * (Dn + Dv), R], kv_b_proj's layout)
    and head_dim >= both Dn + P and Dv (zero padding where they differ: the paged kernel wants one head_dim)."""
    num_rows = latent.shape[0]
    lat = w_kv_b.shape[1]
    rope = latent.shape[1] - lat
    kv = torch.nn.functional.linear(latent[:, :lat], w_kv_b).view(num_rows, num_heads, qk_nope_head_dim + v_head_dim)
    qk_dim = qk_nope_head_dim + rope
    # each part copied once and only the padding zeroed (torch.cat over the broadcast k_pe ran at ~0.9 TB/s)
    k = latent.new_empty((num_rows, num_heads, head_dim))  # [L, heads, D]
    k[..., :qk_nope_head_dim] = kv[..., :qk_nope_head_dim]
    k[..., qk_nope_head_dim:qk_dim] = latent[:, None, lat:]  # k_pe, shared by the heads
    k[..., qk_dim:] = 0
    v = latent.new_empty((num_rows, num_heads, head_dim))  # [L, heads, D]
    v[..., :v_head_dim] = kv[..., qk_nope_head_dim:]
    v[..., v_head_dim:] = 0
    return k, v


def fused_kv_b_weight(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                      rope_dim: int) -> torch.Tensor:
    """w_kv_b [heads * (Dn + Dv), R] -> [heads * (Dn + P + Dv), R + P]: per head W_UK's rows, then P rows of the
    identity that copy the latent's rope part, then W_UV's rows (zeros elsewhere). latent @ it^T is every head's
    [k_nope ‖ k_pe ‖ v] in one GEMM: k_pe passes through exactly (one product by 1, the rest zeros)."""
    lat = w_kv_b.shape[1]
    per_head = w_kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, lat)
    fused = w_kv_b.new_zeros((num_heads, qk_nope_head_dim + rope_dim + v_head_dim, lat + rope_dim))
    fused[:, :qk_nope_head_dim, :lat] = per_head[:, :qk_nope_head_dim]
    fused[:, qk_nope_head_dim:qk_nope_head_dim + rope_dim, lat:] = torch.eye(rope_dim, dtype=w_kv_b.dtype,
                                                                              device=w_kv_b.device)
    fused[:, qk_nope_head_dim + rope_dim:, :lat] = per_head[:, qk_nope_head_dim:]
    return fused.view(-1, lat + rope_dim)


def _fused_weight_of(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                     rope_dim: int) -> torch.Tensor:
    """fused_kv_b_weight, built once per weight: kept on the weight tensor, rebuilt if the weight changed in place
    since (its version counter). An inference-mode tensor has no version counter: its fused weight is built at every
    call."""
    try:
        version = w_kv_b._version
    except RuntimeError:  # an inference tensor: an in-place change would go unseen, so nothing is kept
        return fused_kv_b_weight(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, rope_dim)
    key = (version, num_heads, qk_nope_head_dim, v_head_dim, rope_dim)
    cached = getattr(w_kv_b, "_pagoda_fused_kv_b", None)
    if cached is None or cached[0] != key:
        cached = (key, fused_kv_b_weight(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, rope_dim))
        w_kv_b._pagoda_fused_kv_b = cached  # type: ignore[attr-defined]
    return cached[1]


def expand_latent_overlapped(latent: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                             v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [L, R + P] -> K [L, heads, D] = [k_nope ‖ k_pe] and V [L, heads, D] = [k_pe's last D - Dv values ‖ v]
    (D = Dn + P >= Dv), two overlapping views of one GEMM's output [L, heads, Dn + P + Dv]: no copies and no zero
    padding. Attention over them gives each head's output in its last Dv columns (the first D - Dv are a weighted
    sum of k_pe values, ignored). For kernels that take any row and head strides (FlashAttention)."""
    rope = latent.shape[1] - w_kv_b.shape[1]
    qk_dim = qk_nope_head_dim + rope
    assert qk_dim >= v_head_dim, "V would not fit in K's head dim"
    weight = _fused_weight_of(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, rope)
    both = torch.nn.functional.linear(latent, weight).view(latent.shape[0], num_heads, qk_dim + v_head_dim)
    return both[..., :qk_dim], both[..., v_head_dim:]


def mla_expanded_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                           query_lens: list[int], seqs: list[int], w_kv_b: torch.Tensor, qk_nope_head_dim: int,
                           v_head_dim: int, scale: float, out: torch.Tensor, kv_scale: torch.Tensor | None = None,
                           max_rows: int = EXPAND_MAX_ROWS, config: AttentionConfig | None = None) -> None:
    """Causal attention of the sequences in seqs (the chunks ExpandPolicy picked) with K/V expanded from their
    cached latents: q [T, heads, Dn + P] un-absorbed ([q_nope ‖ q_pe]), w_kv_b [heads * (Dn + Dv), R]. Writes
    their rows of out [T, heads, Dv]; other rows are untouched. seq_lens, query_lens: host lists for the whole
    batch (rows of sequence b are the query_lens[b] after sum(query_lens[:b])). Sequences go in groups of at
    most max_rows latent rows (a longer one alone); config: the paged kernel's launch shape (None: its default).
    Semantics of reference.mla_expanded_attention."""
    num_tokens, num_heads, qk_dim = q.shape
    lat = cache.shape[2] - (qk_dim - qk_nope_head_dim)
    if (cache.dim() != 3 or w_kv_b.shape != (num_heads * (qk_nope_head_dim + v_head_dim), lat)
            or out.shape != (num_tokens, num_heads, v_head_dim)):
        raise ValueError(f"expected cache [N, bs, R + P], w_kv_b [{num_heads} * ({qk_nope_head_dim} + {v_head_dim}), "
                         f"R] and out [T, heads, {v_head_dim}] for q {tuple(q.shape)}, got {tuple(cache.shape)}, "
                         f"{tuple(w_kv_b.shape)}, {tuple(out.shape)}")
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    group: list[int] = []
    group_rows = 0
    for b in seqs:
        if group and group_rows + seq_lens[b] > max_rows:
            _expanded_group(q, cache, block_tables, seq_lens, query_lens, starts, group, w_kv_b, qk_nope_head_dim,
                            v_head_dim, scale, out, kv_scale, config)
            group, group_rows = [], 0
        group.append(b)
        group_rows += seq_lens[b]
    if group:
        _expanded_group(q, cache, block_tables, seq_lens, query_lens, starts, group, w_kv_b, qk_nope_head_dim,
                        v_head_dim, scale, out, kv_scale, config)


def _expanded_group(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                    query_lens: list[int], starts: list[int], seqs: list[int], w_kv_b: torch.Tensor,
                    qk_nope_head_dim: int, v_head_dim: int, scale: float, out: torch.Tensor,
                    kv_scale: torch.Tensor | None, config: AttentionConfig | None) -> None:
    """One launch of the expanded path: gather, expand (one GEMM), then the paged kernel over a temporary
    cache of block size 1 whose block table for sequence b is simply its gathered rows."""
    device = q.device
    num_heads, qk_dim = q.shape[1], q.shape[2]
    head_dim = max(qk_dim, v_head_dim)
    latent = gather_latent_rows(cache, block_tables, seqs, seq_lens, q.dtype, kv_scale)  # [L, R + P]
    lens = [seq_lens[b] for b in seqs]
    qlens = [query_lens[b] for b in seqs]
    # a run of consecutive sequences (every group of a prefill step): its rows are one slice, read and written in
    # place; else gathered and scattered through an index
    span, rows = chunk_rows(starts, query_lens, seqs, device)
    q_sel = read_rows(q, span, rows)  # [T_sel, heads, Dn + P]
    if config is None and _flash_varlen_usable(q_sel, head_dim):
        if qk_dim >= v_head_dim:  # DeepSeek's heads: K and V as views of one GEMM's output, V's values last
            # H200, deepseek-v2-lite prefill 32 x 512 (2026-12-04, bench/results/s25): K and V built by copies from
            # a [k_nope ‖ v] GEMM took 4 copy kernels a layer, 7.7 ms of a 160 ms step
            k, v = expand_latent_overlapped(latent, w_kv_b, num_heads, qk_nope_head_dim, v_head_dim)  # [L, heads, D]
        else:  # V the wider: q and K zero-padded to its head dim, V's values first
            k, v = expand_latent(latent, w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, head_dim)
            q_sel = torch.nn.functional.pad(q_sel, (0, head_dim - qk_dim))
        o = _flash_varlen(q_sel, k, v, qlens, lens, scale)  # [T_sel, heads, D]: the output in the last Dv columns
        write_rows(out, span, rows, o[..., head_dim - v_head_dim:])
        return
    k, v = expand_latent(latent, w_kv_b, num_heads, qk_nope_head_dim, v_head_dim, head_dim)  # [L, heads, D] each
    if head_dim != qk_dim:
        q_sel = torch.nn.functional.pad(q_sel, (0, head_dim - qk_dim))
    max_len = max(lens)
    offsets = torch.tensor([0] + lens[:-1], dtype=torch.int64).cumsum(0)  # [S]
    tables = (offsets[:, None] + torch.arange(max_len)[None, :]).clamp(max=max(sum(lens) - 1, 0))  # [S, max_len]
    qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)  # [S + 1]
    o = paged_attention(q_sel, k.unsqueeze(1), v.unsqueeze(1), tables.to(device=device, dtype=torch.int32),
                        torch.tensor(lens, dtype=torch.int32, device=device), qsl.to(device), max(qlens), max_len,
                        scale, config=config)  # [T_sel, heads, D]
    write_rows(out, span, rows, o[..., :v_head_dim])


def row_span(rows: np.ndarray) -> tuple[int, int] | None:
    """(first, end) when `rows` is first, first + 1, ..., end - 1; else None."""
    if not len(rows) or rows[-1] - rows[0] != len(rows) - 1 or not np.all(np.diff(rows) == 1):
        return None
    return int(rows[0]), int(rows[-1]) + 1


def chunk_rows(starts: list[int] | np.ndarray, query_lens: list[int], seqs: list[int],
               device: torch.device) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """The step's rows of sequences `seqs` (sequence b's are starts[b] .. starts[b] + query_lens[b] - 1): (first,
    end) when they are one run, else (None, their indices [T_sel] int64 on `device`, copied without a sync)."""
    host_rows = np.concatenate([np.arange(starts[b], starts[b] + query_lens[b]) for b in seqs])  # [T_sel]
    span = row_span(host_rows)
    return span, None if span is not None else to_device_async(host_rows.astype(np.int64), device)


def read_rows(x: torch.Tensor, span: tuple[int, int] | None, rows: torch.Tensor | None) -> torch.Tensor:
    """x[rows]: a slice (a view) when the rows are one span, else a gather."""
    if span is not None:
        return x[span[0]:span[1]]
    assert rows is not None
    return x.index_select(0, rows)


def write_rows(out: torch.Tensor, span: tuple[int, int] | None, rows: torch.Tensor | None,
               values: torch.Tensor) -> None:
    """out[rows] = values, through a slice when the rows are one span."""
    if span is not None:
        out[span[0]:span[1]].copy_(values)
    else:
        assert rows is not None
        out.index_copy_(0, rows, values)


# The expanded path's attention on CUDA: FlashAttention's varlen kernel in torch (contiguous per-head K/V, causal
# from the bottom right: a chunk's queries are the last query_len of its seq_len keys), instead of the paged kernel
# over a block-size-1 table with the head padded to 256. deepseek-v2-lite prefill, 64 x 512 tokens on an H200
# (2026-12-02, bench/results/s10/prefill_prof_deepseek-v2-lite.json): the absorbed kernel took 26% of the prefill
# steps' GPU time at ~77 TFLOP/s, 2176 FLOPs a query-key pair and head against the expanded ~768 (V padded to
# 192 for the kernel).
_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_MAX_HEAD_DIM = 256


def _flash_varlen_usable(q: torch.Tensor, head_dim: int) -> bool:
    return (q.is_cuda and q.dtype in _FLASH_DTYPES and head_dim <= _FLASH_MAX_HEAD_DIM and head_dim % 8 == 0
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                  scale: float) -> torch.Tensor:
    """Causal attention of packed sequences: q [T, heads, D] (sequence b's query_lens[b] rows, its last queries),
    k, v [L, heads, D] (its seq_lens[b] keys). Returns [T, heads, D]."""
    device = q.device
    cu_q = to_device_async(np.cumsum([0, *query_lens], dtype=np.int32), device)  # [S + 1]
    cu_k = to_device_async(np.cumsum([0, *seq_lens], dtype=np.int32), device)  # [S + 1]
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max(query_lens), max(seq_lens), 0.0, True,
                                                  False, scale=scale)
    return out[0]  # (output, logsumexp, rng state, unused, debug mask)
