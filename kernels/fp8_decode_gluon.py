"""Decode attention over an fp8 (e4m3) paged KV cache, pipelined by hand (Gluon, Hopper sm_90).

The Triton decode kernel (paged_attention.py, `qk_fp8x2`) leaves each program's copies and arithmetic in series:
Triton's pipeliner issues the next key tile's cp.async copies at the end of the loop body and waits for all of them
at the top (sm_90 SASS, bench/RESULTS.md, twenty-second session), and V, converted in registers, never gets a
second buffer. This kernel keeps a ring of STAGES raw e4m3 K/V tiles in shared memory: while a program computes
tile j, the copies of tiles j + 1 .. j + STAGES - 1 are in flight. Per tile:

  S^T [TILE_N, BLOCK_M] = K [TILE_N, D] . q^T     e4m3 wgmma(s) on K as copied, q as hi + lo e4m3 rows ("qk_fp8x2")
  P^T = exp2(S^T - m)                             running max over the keys (axis 0), sums kept per key slot
  V (e4m3, smem) -> fp16 in registers -> smem     one cvt.rn.f16x2.e4m3x2 a pair; into the tile's own ring slot
  acc^T [D, N_OUT] += V^T . P^T                   fp16 wgmma, both operands from shared memory

One program per (kv head, sequence, split), 4 warps (one warpgroup): the GROUP query heads of a kv head sit on the
dots' N side, the keys on M. With GROUP <= 8 (PACKED) q's hi and lo rows share one 16-column score dot and the rest
runs on 8 columns; else two dots of BLOCK_M >= 16 columns. Same semantics as the Triton decode launch
(reference.paged_attention): length-1 queries only, program `num_seqs` zeroes the padding rows [qsl[B], T), splits
write partials for paged_attention's split reduce. H200 timings and the variants that lost (deeper rings, an
overlapped loop): bench/RESULTS.md, twenty-fourth session. Gluon runs on the GPU only (not in Triton's interpreter);
`tests/gpu_compile.py` compiles it for sm_90 on the CPU and tests/test_fp8_decode_gluon.py checks it on the GPU.
"""

from __future__ import annotations

import functools
import logging

import torch
from triton.compiler.errors import CompilationError
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources, PTXASError

from pagoda.shared.config import triton_interpreted

logger = logging.getLogger(__name__)

NEG_BIG = gl.constexpr(-1.0e30)  # the running max before any key (as in paged_attention.py)
E4M3_MAX = gl.constexpr(448.0)
NUM_WARPS = gl.constexpr(4)  # one warpgroup: the wgmma's M atom is 4 warps x 16 rows


@functools.lru_cache(maxsize=16)
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def on_hopper(q: torch.Tensor) -> bool:
    """q lives on an sm_90 GPU (the Gluon kernel's wgmma path), outside Triton's interpreter (which runs no Gluon)."""
    if triton_interpreted() or not q.is_cuda:
        return False
    return _major(q.device.index if q.device.index is not None else torch.cuda.current_device()) == 9


def supports(q: torch.Tensor, head_dim: int, group: int, tile_n: int, stages: int) -> bool:
    """Whether this kernel serves a decode launch: on_hopper, a 16-bit q, a power-of-two head_dim of 64..256 (the PV
    dot's M: a wgmma's 64 rows), at most 64 query heads a kv head (the dots' N side), 64-key tiles (the wgmma's M; 128
    failed its GPU test in the packed layout, H200 2026-12-04) and 2..4 ring slots."""
    return (head_dim in (64, 128, 256) and group <= 64 and tile_n == 64 and 2 <= stages <= 4
            and q.dtype in (torch.float16, torch.bfloat16) and on_hopper(q))


_FAILED_SHAPES: set[tuple[object, ...]] = set()  # launch shapes that did not compile: the caller runs Triton's


def _shape_key(options: dict[str, object]) -> tuple[object, ...]:
    return tuple(sorted((name, value) for name, value in options.items() if name != "launch_pdl"))


def launch(grid: tuple[int, int, int], args: tuple[object, ...], **options: object) -> bool:
    """fp8_decode_kernel[grid](*args, **options), or False, without launching, for a shape that failed to compile.
    Gluon is an experimental Triton API: a compile failure (or a launch the device cannot hold) is logged once and
    the caller runs the Triton decode launch for that shape from then on."""
    if _FAILED_SHAPES and _shape_key(options) in _FAILED_SHAPES:  # the key is built only once something failed
        return False
    try:
        fp8_decode_kernel[grid](*args, **options)
    except (CompilationError, OutOfResources, PTXASError, RuntimeError) as exc:
        key = _shape_key(options)
        _FAILED_SHAPES.add(key)
        logger.warning("Gluon fp8 decode kernel unavailable for %s (%s: %s); the Triton launch serves it", dict(key),
                       type(exc).__name__, str(exc)[:300])
        return False
    return True


@gluon.jit
def _split_rows_e4m3(x):
    """q ~= hi * hi_scale + lo * lo_scale for [R, C] fp32 x: (hi, hi_scale, lo, lo_scale), hi and lo e4m3 [R, C],
    scales [R] fp32 (row amax / 448; 1 for a zero row). hi is x / hi_scale rounded to nearest even on e4m3's grid in
    fp32 arithmetic (spacing 2^(exponent - 3), 2^-9 below the normals; the 1.5 * 2^23 add/subtract rounds), so its
    cast is exact and the residual x - hi * hi_scale needs no conversion back from e4m3 (on the H200 that
    conversion, in this kernel's layouts, gave wrong residuals)."""
    amax = gl.max(gl.abs(x), 1)  # [R]
    amax = gl.where(amax > 0.0, amax, E4M3_MAX)
    y = gl.minimum(gl.maximum(x * gl.expand_dims(E4M3_MAX / amax, 1), -E4M3_MAX), E4M3_MAX)  # |y| <= 448
    exponent = (y.to(gl.int32, bitcast=True) >> 23) & 0xFF
    spacing = ((gl.maximum(exponent, 127 - 6) - 3) << 23).to(gl.float32, bitcast=True)
    y_hi = ((y / spacing + 12582912.0) - 12582912.0) * spacing  # y on the e4m3 grid
    hi_scale = amax / E4M3_MAX
    residual = (y - y_hi) * gl.expand_dims(hi_scale, 1)  # [R, C]: x - hi * hi_scale
    lo_amax = gl.max(gl.abs(residual), 1)
    lo_amax = gl.where(lo_amax > 0.0, lo_amax, E4M3_MAX)
    y_lo = gl.minimum(gl.maximum(residual * gl.expand_dims(E4M3_MAX / lo_amax, 1), -E4M3_MAX), E4M3_MAX)
    return y_hi.to(gl.float8e4nv), hi_scale, y_lo.to(gl.float8e4nv), lo_amax / E4M3_MAX


@gluon.jit
def _issue_tile(k_slot, v_slot, k_cache_ptr, v_cache_ptr, block_table_row, tile, key_limit, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, copy_layout: gl.constexpr):
    """cp.async of key tile `tile` (K and V rows, e4m3 as stored) into one ring slot, then one commit group. Rows at or
    past key_limit (the sequence's end, or the split's) are zero-filled and read nothing: a tile wholly past it
    (the ring's look-ahead beyond the last tile) issues an empty group."""
    key = tile * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(1, copy_layout))  # [TILE_N]
    key_ok = key < key_limit
    block = gl.load(block_table_row + key // BLOCK_SIZE, mask=key_ok, other=0)
    block = block.to(gl.uint32).to(gl.int64)  # one 32 x 32 wide multiply an address
    slot = key % BLOCK_SIZE
    offs_d = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout)), 0)  # [1, D]
    k_rows = gl.expand_dims(block * stride_kb + slot * stride_ks + kv_head * stride_kh, 1)  # [TILE_N, 1]
    v_rows = gl.expand_dims(block * stride_vb + slot * stride_vs + kv_head * stride_vh, 1)
    mask = gl.expand_dims(key_ok, 1)
    async_copy.async_copy_global_to_shared(k_slot, k_cache_ptr + k_rows + offs_d, mask=mask)
    async_copy.async_copy_global_to_shared(v_slot, v_cache_ptr + v_rows + offs_d, mask=mask)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def fp8_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr, TILE_N: gl.constexpr, NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr,
        USE_PDL: gl.constexpr, PACKED: gl.constexpr = False):
    """Grid (kv heads, num_seqs + 1, splits). qk_scale: softmax scale * log2(e). HEAD_DIM a power of two in 64..256,
    TILE_N 64 (the wgmma's M), BLOCK_M >= GROUP a power of two >= 16 (the score dot's N), STAGES >= 2 ring slots.
    PACKED (GROUP <= BLOCK_M // 2): q's two e4m3 terms share one score dot, the hi rows on its first BLOCK_M // 2
    columns and the lo rows on the rest (each thread of a wgmma accumulator holds columns c and c + 8 side by side),
    so K is read once a tile and the softmax and PV dot run on BLOCK_M // 2 columns."""
    if USE_PDL == 1:
        gdc_launch_dependents()
    if USE_PDL > 0:
        gdc_wait()
    kv_head = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    N_OUT: gl.constexpr = BLOCK_M // 2 if PACKED else BLOCK_M  # the PV dot's N: query heads a program outputs

    # Register layouts. Copies, q and V's conversion: 16 bytes a thread along a row (q's e4m3 rows then reach shared
    # memory by 16-byte stores: from a [1, 4] layout Triton 3.6 stored them with stmatrix, and the scores came out
    # wrong on the H200). The dots: wgmma accumulators.
    TPW_D: gl.constexpr = HEAD_DIM // 16
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_D, TPW_D], [NUM_WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 32])  # e4m3: k = 32
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, N_OUT, 16])  # fp16: k = 16
    # Shared memory: the ring of e4m3 K and V tiles (a tile's slot later holds its fp16 V), q's e4m3 rows, P^T.
    kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(HEAD_DIM, 128), element_bitwidth=8,
                                                        rank=2)
    v16_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=N_OUT * 2 if N_OUT >= 16 else 0,
                                                       element_bitwidth=16, rank=2)

    offs_n = gl.arange(0, N_OUT, layout=gl.SliceLayout(0, o_layout))  # [N_OUT] query head within the group
    offs_od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))  # [D]
    row_head = kv_head * GROUP + offs_n
    head_ok = offs_n < GROUP
    if b == num_seqs:  # the padding tail [qsl[B], T): empty rows (zero output, or an empty split)
        zeros = gl.zeros([HEAD_DIM, N_OUT], gl.float32, o_layout)
        for token in range(gl.load(query_start_loc_ptr + num_seqs), num_tokens):
            _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, zeros,
                        gl.zeros([N_OUT], gl.float32, gl.SliceLayout(0, o_layout)),
                        gl.full([N_OUT], NEG_BIG, gl.float32, gl.SliceLayout(0, o_layout)),
                        token.to(gl.int64), row_head, head_ok, offs_od, split, stride_ot, stride_oh, NUM_HEADS,
                        HEAD_DIM, NUM_SPLITS)
        return
    q_start = gl.load(query_start_loc_ptr + b)
    q_len = gl.load(query_start_loc_ptr + b + 1) - q_start
    if q_len != 1:  # chunks belong to the tiled launch; empty sequences own no rows
        return
    token = q_start.to(gl.int64)
    kv_end = gl.load(seq_lens_ptr + b)  # the decode row attends keys 0 .. seq_len - 1
    num_tiles = gl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = gl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = gl.minimum(tile_lo + per_split, num_tiles)
        if tile_lo >= tile_hi:  # no key here: (max, sum) = (NEG_BIG, 0) tell the reduce to skip this split
            part_row = (token * NUM_HEADS + row_head) * NUM_SPLITS + split
            gl.store(part_max_ptr + part_row, gl.full([N_OUT], NEG_BIG, gl.float32, gl.SliceLayout(0, o_layout)),
                     mask=head_ok)
            gl.store(part_sum_ptr + part_row, gl.zeros([N_OUT], gl.float32, gl.SliceLayout(0, o_layout)),
                     mask=head_ok)
            return
    else:
        tile_lo = num_tiles * 0
        tile_hi = num_tiles
    key_limit = gl.minimum(kv_end, tile_hi * TILE_N)

    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * TILE_N, HEAD_DIM], kv_smem_layout)  # K, then V
    block_table_row = block_tables_ptr + b.to(gl.int64) * stride_bt
    for first in gl.static_range(STAGES - 1):  # the ring's first tiles go out before q is prepared
        _issue_tile(ring.index(first).slice(0, TILE_N), ring.index(first).slice(TILE_N, TILE_N), k_cache_ptr,
                    v_cache_ptr, block_table_row, tile_lo + first, key_limit, kv_head, stride_kb, stride_ks,
                    stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N, HEAD_DIM, copy_layout)

    # q rows as two e4m3 terms with per-row scales. Row r is head r of the group (zero past GROUP); PACKED: rows
    # r < N_OUT hold head r's hi term, rows N_OUT + r its lo term.
    q_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    q_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    q_head = q_rows % N_OUT if PACKED else q_rows
    q = gl.load(q_ptr + token * stride_qt + gl.expand_dims((kv_head * GROUP + q_head) * stride_qh, 1)
                + gl.expand_dims(q_cols, 0), mask=gl.expand_dims(q_head < GROUP, 1), other=0.0).to(gl.float32)
    q_hi, scale_hi, q_lo, scale_lo = _split_rows_e4m3(q)  # [BLOCK_M, D] e4m3 each, [BLOCK_M] scales
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(HEAD_DIM, 128), element_bitwidth=8,
                                                       rank=2)
    score_scale = qk_scale * gl.load(k_scale_ptr)
    if PACKED:
        is_hi = q_rows < N_OUT
        q_packed = gl.where(gl.expand_dims(is_hi, 1), q_hi, q_lo)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], q_smem_layout, q_packed)
        sc_packed = gl.where(is_hi, scale_hi, scale_lo) * score_scale
        sc_hi = gl.expand_dims(gl.convert_layout(sc_packed, gl.SliceLayout(0, s_layout)), 0)  # [1, BLOCK_M]
        sc_lo = sc_hi  # unused
        q_hi_t = q_smem.permute((1, 0))  # [D, BLOCK_M]: the score dot's K-major B operand
        q_lo_t = q_hi_t  # unused
    else:
        q_hi_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], q_smem_layout, q_hi)
        q_lo_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], q_smem_layout, q_lo)
        sc_hi = gl.expand_dims(gl.convert_layout(scale_hi, gl.SliceLayout(0, s_layout)) * score_scale, 0)
        sc_lo = gl.expand_dims(gl.convert_layout(scale_lo, gl.SliceLayout(0, s_layout)) * score_scale, 0)
        q_hi_t = q_hi_smem.permute((1, 0))
        q_lo_t = q_lo_smem.permute((1, 0))
    p_smem = gl.allocate_shared_memory(gl.float16, [TILE_N, N_OUT], p_smem_layout)

    s_zero = gl.zeros([TILE_N, BLOCK_M], gl.float32, s_layout)
    zero_scores = _scores(s_zero, s_zero, sc_hi, sc_lo, PACKED, TILE_N, N_OUT)  # [TILE_N, N_OUT] in their layout
    m_i = gl.max(zero_scores, 0) + NEG_BIG  # [N_OUT]
    l_i = zero_scores  # softmax sums per key slot, summed after the loop
    acc = gl.zeros([HEAD_DIM, N_OUT], gl.float32, o_layout)  # out^T
    offs_key = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, s_layout))
    for j in range(tile_lo, tile_hi):
        i = j - tile_lo
        # tile j's group is the oldest of the STAGES - 1 outstanding; after the barrier every thread's copies of it
        # have landed and every thread is done with the slot of tile j - 1, which the next copies overwrite
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        ahead = (i + STAGES - 1) % STAGES
        _issue_tile(ring.index(ahead).slice(0, TILE_N), ring.index(ahead).slice(TILE_N, TILE_N), k_cache_ptr,
                    v_cache_ptr, block_table_row, j + STAGES - 1, key_limit, kv_head, stride_kb, stride_ks,
                    stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, TILE_N, HEAD_DIM, copy_layout)
        slot = i % STAGES
        k_tile = ring.index(slot).slice(0, TILE_N)
        s_hi = warpgroup_mma(k_tile, q_hi_t, s_zero, use_acc=False, is_async=True)
        if PACKED:
            s_lo = s_hi
        else:
            s_lo = warpgroup_mma(k_tile, q_lo_t, s_zero, use_acc=False, is_async=True)
        v8 = ring.index(slot).slice(TILE_N, TILE_N).load(copy_layout)  # [TILE_N, D] e4m3, beside the dots
        if PACKED:
            s_hi = warpgroup_mma_wait(0, deps=(s_hi, ))
            s_lo = s_hi
        else:
            s_hi, s_lo = warpgroup_mma_wait(0, deps=(s_hi, s_lo))
        # the slot's 16 KB take V's fp16 copy once the score dots are done with K and every thread holds its V bytes
        # (one barrier more a tile, 16 KB less a program than a buffer of its own: 4 programs an SM)
        gl.thread_barrier()
        v16_smem = ring.index(slot)._reinterpret(gl.float16, [TILE_N, HEAD_DIM], v16_smem_layout)
        v16_smem.store(v8.to(gl.float16))
        s = _scores(s_hi, s_lo, sc_hi, sc_lo, PACKED, TILE_N, N_OUT)  # [TILE_N, N_OUT], log2 units
        key_ok = gl.convert_layout(gl.expand_dims(j * TILE_N + offs_key < key_limit, 1), s.type.layout)
        s = gl.where(key_ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))  # [TILE_N, N_OUT]
        l_i = l_i * gl.expand_dims(alpha, 0) + p
        m_i = m_new
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, o_layout)), 0)
        acc = warpgroup_mma(v16_smem.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    async_copy.wait_group(0)  # the look-ahead groups (empty past the last tile) retire before the program ends

    l_sum = gl.convert_layout(gl.sum(l_i, 0), gl.SliceLayout(0, o_layout))  # [N_OUT]
    m_out = gl.convert_layout(m_i, gl.SliceLayout(0, o_layout))
    acc = acc * gl.load(v_scale_ptr)  # sum_j p_j (v_j * v_scale)
    _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, acc, l_sum, m_out, token, row_head, head_ok,
                offs_od, split, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, NUM_SPLITS)


@gluon.jit
def _scores(s_hi, s_lo, sc_hi, sc_lo, PACKED: gl.constexpr, TILE_N: gl.constexpr, N_OUT: gl.constexpr):
    """A tile's scores in log2 units, [TILE_N, N_OUT]: hi * hi_scale + lo * lo_scale. PACKED: the one dot's columns
    [0, N_OUT) are the hi terms and [N_OUT, 2 N_OUT) the lo terms of the same heads (s_lo unused)."""
    if PACKED:
        scores = gl.sum(gl.reshape(s_hi * sc_hi, [TILE_N, 2, N_OUT]), 1)  # [key, term, head] summed over the terms
    else:
        scores = s_hi * sc_hi + s_lo * sc_lo
    return scores


@gluon.jit
def _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, acc, l_sum, m_i, token, row_head, head_ok,
                offs_d, split, stride_ot, stride_oh, NUM_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
                NUM_SPLITS: gl.constexpr):
    """acc^T [D, BLOCK_M] of one token's group heads: normalised into out, or with splits the unnormalised partial
    and its (max, sum) (the layout paged_attention's split reduce reads: [T, heads, splits, D])."""
    mask = gl.expand_dims(head_ok, 0)
    if NUM_SPLITS > 1:
        part_row = (token * NUM_HEADS + row_head) * NUM_SPLITS + split  # [BLOCK_M]
        gl.store(part_max_ptr + part_row, m_i, mask=head_ok)
        gl.store(part_sum_ptr + part_row, l_sum, mask=head_ok)
        gl.store(part_out_ptr + gl.expand_dims(part_row * HEAD_DIM, 0) + gl.expand_dims(offs_d, 1), acc, mask=mask)
    else:
        out = acc / gl.expand_dims(gl.where(l_sum > 0.0, l_sum, 1.0), 0)
        ptrs = out_ptr + token * stride_ot + gl.expand_dims(row_head * stride_oh, 0) + gl.expand_dims(offs_d, 1)
        gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
