"""Triton paged attention: causal GQA attention of a flattened batch of query chunks over the paged KV cache."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagoda.kernels import fp8_decode_gluon, pdl
from pagoda.shared.config import measurement_switch, triton_interpreted

# Finite stand-in for -inf as the running max: a row that has seen no key yet computes
# exp2(NEG_BIG - NEG_BIG) = 1 times a zero sum, never exp2(-inf - -inf) = nan.
_NEG_BIG = tl.constexpr(-1.0e30)
_LOG2E = math.log2(math.e)
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 64  # a power of two (pick_num_splits rounds down to powers of two)
_INDEX_DTYPES = (torch.int32, torch.int64)
# How K/V tiles of an fp8 (e4m3) cache reach the tensor cores when q is 16-bit (an fp32 q always upcasts to fp32):
#   "native": to q's dtype. For bf16 Triton emits cvt e4m3x2 -> f16x2 then two cvt f16 -> bf16 per pair: three
#             conversions a pair of elements, which made decode instruction-bound (issue 25).
#   "f16":    to fp16 with one cvt.rn.f16x2.e4m3x2 a pair (exact: every e4m3 value is an fp16). q is scaled once
#             per program to fp16 (its amax to 256, the inverse folded into the softmax scale), so the dots run on
#             fp16 operands; p is fp16 too (finer than bf16 in [0, 1]).
#   "f16_bits": fp16 by integer ops: bits = sign << 15 | (e4m3 & 0x7f) << 7 is the fp16 of e4m3 * 2^-8 (the
#             exponent biases differ by 15 - 7 = 8; e4m3 subnormals land on fp16 subnormals with the same factor);
#             the 2^8 is folded into the scales. The e4m3 NaN (0x7f) would read as 480; the cache never holds one.
#   "f16_words": K and V tiles loaded as int32 words and converted to fp16 in the load's layout (two
#             cvt.rn.f16x2.e4m3x2 a word), before the layout change into the dot operands. With "f16" the compiler
#             sinks the conversion past that change: V (whose reduction axis, the keys, is strided) was then gathered
#             from shared memory one byte at a time (LDS.U8 + byte packing: 128 LDS.U8 a thread per 128-key tile)
#             and the tile took 248 registers; as words it takes 142 (sm_90 SASS, tests/gpu_compile.py's compiler).
#   "f16_vwords": V as words, K as "f16" (its e4m3 tile reaches the dot by ldmatrix and converts there).
#   "qk_fp8": QK^T on fp8 tensor cores: each q row (one query head) is quantized once per program to e4m3 with
#             its own scale (row amax / 448), the K tile goes to the dot as loaded (no conversion), the fp32 scores
#             are rescaled by q_scale[row] * k_scale * softmax scale; V as in "f16_words". q keeps 3 mantissa bits
#             (relative rounding <= 2^-4 an element): an accuracy trade, so it is selectable, not the default.
#             Decode needs decode_keys_on_m for the fp8 MMA (sm_90 SASS: QGMMA.64x16x32.E4M3, 365 loop instructions
#             a 64-key tile vs 487 for f16_words); with the 16 query rows on M Triton emits mma.sync on fp16 and
#             converts K there after all. Chunks (128-row tiles) get QGMMA as they are.
#   "qkv_fp8": "qk_fp8" and PV on fp8 tensor cores too (the FlashAttention-3 way): p (in [0, 1]) times 2^8 rounded
#             to e4m3 (its 2^-9 floor then sits at p = 2^-17), the V tile as loaded; the 2^-8 goes into v_scale. The
#             softmax sum l adds the unrounded fp32 p.
#   "f16_pinned": "f16" with each converted tile passed through an opaque identity (one PTX mov a pair, which
#             ptxas folds away) right after the cast: the compiler can no longer move the conversion past the
#             layout change, so the e4m3 tiles go to shared memory by cp.async as loaded (pipelined like bf16's),
#             are read back, converted in the load's layout and take bf16's path into the dots (ldmatrix).
#             sm_90 SASS, llama3-8b heads, 64-key decode tile: 338 loop instructions against 487 for f16_words
#             (105 of its 487 register moves) and 320 for a bf16 cache (python -m pagoda.bench.attention_sass).
#             Fewer instructions, yet slower on the H200 (2026-12-03, kv_fp8_bench, B=256, contexts 512-768, a
#             layer): 167-169 us against 151-152 for f16_words at 64 keys and 146-149 for the default launch shape
#             (bf16 cache 186-188); 128-key tiles 189-192. Kept selectable, not the default.
#   "qk_fp8x2": "qk_fp8" with q as the sum of two e4m3 rows, q ~= hi * s_hi + lo * s_lo (lo: the rounding error
#             of hi, quantized with its own row scale), and two fp8 dots over the same K tile: q keeps ~7 mantissa
#             bits instead of 3 (relative rounding <= 2^-8 of the row's amax, as fine as a 16-bit q), for one more
#             QGMMA a tile. V as in "f16_words". pick_config's decode choice over an fp8 cache (H200, 2026-12-03:
#             145.1 / 141.8 us a layer against f16_words' 147.4 / 144.5, qwen3-0.6b / llama3-8b, B=256); its
#             128-row chunk tiles were slower than the default's there (122-225 us against 87-166), so chunks keep
#             f16_words.
FP8_CONVERTS = ("native", "f16", "f16_bits", "f16_words", "f16_vwords", "qk_fp8", "qkv_fp8", "f16_pinned",
                "qk_fp8x2")
_FP8_MMA_CONVERTS = ("qk_fp8", "qkv_fp8", "qk_fp8x2")  # e4m3 dots on the tensor cores (K >= 32)
_FP8_MODE = {"native": 1, "f16": 2, "f16_bits": 3, "f16_words": 4, "f16_vwords": 5, "qk_fp8": 6,
             "qkv_fp8": 7, "f16_pinned": 8, "qk_fp8x2": 9}  # 0: no fp8 cache
_FP8_MMA_MODES = tuple(_FP8_MODE[convert] for convert in _FP8_MMA_CONVERTS)
_P_E4M3_MULT = tl.constexpr(256.0)
_E4M3_MAX = tl.constexpr(448.0)
_F16_Q_AMAX = tl.constexpr(256.0)  # q amax after its fp16 scaling: products exact in fp32, far from overflow


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Launch shapes of one paged_attention call. Host-side only, so one batch size keeps one shape (CUDA graphs).
    Decode sequences (query length 1) run one program per (sequence, kv head); longer chunks run in tiles of
    prefill_block_m rows = prefill_block_m // G query tokens x G heads."""

    num_splits: int = 1  # KV splits per program (flash decoding); 1 = no split, no reduce kernel
    decode_tile_n: int = 64  # keys per inner-loop step (power of two >= 16), any multiple/fraction of block_size
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_block_m: int = 128  # score-tile rows (power of two >= 16)
    prefill_tile_n: int = 32
    prefill_num_warps: int = 8
    prefill_num_stages: int = 1
    heads_fast: bool = False  # grid axis 0 = kv head: a sequence's kv heads run side by side (adjacent cache bytes)
    fp8_convert: str = "f16_words"  # fp8 cache with a 16-bit q: how K/V tiles are converted (FP8_CONVERTS)
    decode_keys_on_m: bool = False  # decode dots transposed: keys on the M rows, the G query heads on N
    # Decode softmax sums kept per key slot of the tile ([TILE_N, rows], rescaled with the accumulator) and summed
    # once after the loop: no cross-warp sum a tile (sm_90 SASS, qk_fp8x2 64-key tiles keys on M: 394 -> 354 loop
    # instructions, 8 -> 5 barriers; python -m pagoda.bench.attention_sass)
    decode_lazy_sum: bool = False
    # The decode launch's fp8 conversion where it differs from the tiled launch's (steps mixing decode rows and
    # chunks over an fp8 cache); "": fp8_convert for both
    decode_fp8_convert: str = ""
    # Key tiles a decode loop iteration runs (Triton's loop_unroll_factor): their copies go out together, one wait
    # for all of them; more shared memory a program
    decode_unroll: int = 1
    decode_max_regs: int = 0  # ptxas register cap a thread for the decode launch (maxnreg); 0: the compiler's choice
    # Decode runs every key tile in one masked loop instead of a loop over the whole tiles and a second one for the
    # partial last tile (whose copies, issued only after the first loop, wait a full memory round trip)
    decode_one_loop: bool = False
    # Decode over an fp8 cache by the hand-pipelined Gluon kernel (kernels/fp8_decode_gluon.py: a ring of
    # decode_num_stages e4m3 K/V tiles in shared memory, copies of the next tiles in flight while a tile computes) where
    # it applies (qk_fp8x2 and fp8_decode_gluon.supports: an sm_90 GPU, head_dim 64 / 128 / 256, 64-key tiles); else
    # the Triton launch
    decode_pipelined: bool = False
    # The Gluon kernel with q's two e4m3 terms in one score dot (groups of up to 8 query heads a kv head): K read once a
    # tile, the softmax and PV dot on 8 columns (sm_90 SASS, qwen3-0.6b heads: 280 loop instructions against 340,
    # 76 registers against 109, 6 programs an SM against 4)
    decode_packed: bool = True
    # Tiled launch over an fp8 cache: the program's scaled q (fp16 or e4m3, computed in registers) is stored to its
    # own output rows and loaded back, so it reaches the dots from shared memory as a loaded bf16 q does. Triton
    # keeps a computed dot operand in registers: +32 to 50 a thread, 1 program an SM instead of 2 (the fp8 chunk
    # path's loss against bf16, issue 25; sm_90 SASS: python -m pagoda.bench.attention_sass --chunk).
    fp8_q_staged: bool = True
    prefill_max_regs: int = 0  # ptxas register cap a thread for the tiled launch (maxnreg); 0: the compiler's choice


# Decode rows beside chunks over an fp8 cache: the decode-only launch (qk_fp8x2, keys on M, sums per key slot; 8-11%
# faster than f16_words with keys on N in decode-only batches) in place of the chunks' f16_words. In a step of 124
# decode rows beside 4 x 512 queries over 1024 cached tokens the chunks dominate: fp8 / bf16 time 0.969x / 1.028x
# (qwen3-0.6b / llama3-8b) against 0.961x / 1.045x before, within that bench's run-to-run spread (H200, 2026-12-04)
_FP8_DECODE_ROWS = {"decode_fp8_convert": "qk_fp8x2", "decode_keys_on_m": True, "decode_lazy_sum": True}
# fp8-cache chunks up to this many queries: q in registers on 64-key tiles (faster there than staged; measured at 64)
FP8_SHORT_CHUNK = 64


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(num_tokens: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                    num_sms: int = 132) -> int:
    """Split-KV only for decode batches too small to fill the GPU: aim for ~4 programs per SM, with at least one
    64-key tile per split. Measured on an H200 (llama3-8b, bf16): B=1 ctx=2048 37.6 us -> 8.7 us with 16 splits,
    B=4 ctx=4096 104 -> 24 us, B=8 ctx=2048 55 -> 25 us. Depends on host ints only: under CUDA graphs pass
    max_seq_len = max_model_len so the choice stays fixed for a batch size. The result is a power of two (rounded
    down): NUM_SPLITS is a kernel constant, so these seven values are the only decode variants an eager batch can
    need, and the worker's warm-up compiles all of them."""
    if max_query_len > 1:
        return 1
    base = num_tokens * num_kv_heads  # programs without splitting
    if base >= num_sms:
        return 1
    by_occupancy = -(-4 * num_sms // max(base, 1))
    by_length = max(1, max_seq_len // 64)
    splits = max(1, min(_MAX_SPLITS, by_occupancy, by_length))
    return 1 << (splits.bit_length() - 1)  # largest power of two <= splits


def check_batch_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> int:
    """The paged batch description every attention kernel reads: raises ValueError on a bad one; returns B."""
    if block_tables.dim() != 2 or block_tables.dtype not in _INDEX_DTYPES or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B, max_blocks] int32/int64, row-contiguous, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in _INDEX_DTYPES or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be [B={num_seqs}] int32/int64 contiguous, got {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype}")
    if (query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in _INDEX_DTYPES
            or not query_start_loc.is_contiguous()):
        raise ValueError(f"query_start_loc must be [B + 1 = {num_seqs + 1}] int32/int64 contiguous, got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    return num_seqs


@functools.lru_cache(maxsize=256)
def pick_config(num_tokens: int, num_seqs: int, num_kv_heads: int, group_size: int, max_query_len: int,
                max_seq_len: int, num_sms: int = 132, fp8_kv: bool = False, head_dim: int = 128) -> AttentionConfig:
    """Default launch shapes, from an H200 sweep (python -m pagoda.bench.kernels --sweep, llama3-8b, bf16).
    Decode: 64-key tiles, 4 warps (B=256 ctx=2048 at 4.3 TB/s). Prefill-only steps (8x512): 128-row tiles of
    32 keys, 8 warps, 1 stage (88.7 us; the old 128/64/8/2 was ~10% slower). Steps that are mostly decode rows
    plus a few chunks (4x512 + 124 decodes): 64-row tiles of 64 keys (277 us vs 310 us). Decode-only batches put
    the kv heads on grid axis 0 (bench/decode_profile.py --sweep). An fp8 cache (fp8_kv) converts K/V as 32-bit
    words (f16_words) on 64-key tiles in decode and in chunks: H200, 2026-12-02 (bench/kv_fp8_bench.py, graph-timed),
    B=256 ctx 1024 llama3-8b 211 us vs 214 us with 128-key tiles and 286 us for bf16; B=64 ctx 512-768 42 vs 52 us.
    Chunks over an fp8 cache were ~20% slower than bf16 (same call: 4x512 queries over 1024 cached tokens, 201 us
    vs 159 us): the fp16-scaled q, a computed dot operand, stayed in registers (176-193 a thread, one 8-warp
    program an SM; bf16's loaded q sits in shared memory: 125, two programs). Now q is staged through memory
    (fp8_q_staged) and the 128-row launch capped at 128 registers: bf16's 32-key tiles, two programs an SM, the
    same SASS loop length as bf16 (4176 warp instructions per 128 rows x 64 keys; 2 spill instructions, both
    outside the loop), at half the KV bytes (python -m pagoda.bench.attention_sass --chunk). To be confirmed on the
    GPU: python -m pagoda.bench.kv_fp8_bench --chunks-only (fp8_default vs fp8_unstaged_t64, the old choice).
    The cap is for head_dim <= 128 (a 128 x 256 fp32 accumulator alone fills 128 registers). Measured on the H200
    (2026-12-02, bench/results/s9/kv_fp8_chunks.json): 4 x 512 queries over 1024 cached, staged 86.4 / 164.5 us
    (qwen3-0.6b / llama3-8b) against unstaged 64-key tiles 109.5 / 202.8 and bf16 83.9 / 160.3; 4 x 64 queries,
    unstaged 64-key tiles 45.5 / 44.7 against staged 55.6 / 57.9 and bf16 54.5 / 56.2: chunks of at most
    FP8_SHORT_CHUNK queries keep the unstaged shape. H200, 2026-12-03 (bench/results/s19/kv_fp8_candidates.json,
    kv_fp8_bench --quick): longer staged chunks on 64-key tiles instead of 32, 4 x 512 queries over 1024 cached,
    74.1 / 148.8 us (qwen3-0.6b / llama3-8b) against 87.2 / 166.0; decode over an fp8 cache with QK^T on the fp8
    tensor cores and q as two e4m3 terms (qk_fp8x2, keys on the dots' M rows; error below f16_words'), B=256
    contexts 512-768, 145.1 / 141.8 us a layer against f16_words' 147.4 / 144.5, and whole decode steps (step_ab,
    graph-timed) llama3-8b FP8 B=256 ctx 1024 11.598 ms against 11.786, qwen3-0.6b B=256 5.170 against 5.256."""
    num_splits = pick_num_splits(num_tokens, num_kv_heads, max_query_len, max_seq_len, num_sms)
    if max_query_len <= 1:
        # Decode-only: kv heads first on the grid, so one sequence's heads read their blocks' adjacent bytes
        # together (H200, qwen3-0.6b, B=256, contexts 512-768: 166 -> 160 us per layer, 4.04 -> 4.19 TB/s).
        if fp8_kv:  # H200 (2026-12-03, see above): QK^T on fp8 tensor cores, q as two e4m3 terms; the softmax
            # sums per key slot (2026-12-04: 139.5 / 142.1 -> 134.1 / 132.4 us a layer, qwen3-0.6b / llama3-8b).
            # Split launches (small batches) in one stage: B=1, llama3-8b, contexts 512-768 / 1024 / 4096, 7.1-7.2 /
            # 7.7 / 10.6-10.7 us a layer against 7.5 / 8.3 / 11.4-11.5 in two (two calls, H200, 2026-12-04,
            # bench/results/s23); unsplit batches (B=64, 256) level within 1-3% either way, so they keep two.
            # Unsplit launches on an sm_90 GPU run the hand-pipelined Gluon kernel (kernels/fp8_decode_gluon.py, a
            # ring of 2 e4m3 K/V tiles, q's two terms in one score dot): H200, 2026-12-04 (bench/results/s24), one
            # layer, llama3-8b B=256 contexts 512-768 / 1024 102.4 / 150.0 us against 124.5 / 181.3, B=64 30.1
            # against 36.4, qwen3-0.6b B=256 1024 146.4 against 182.8; whole decode steps qwen3-0.6b B=256 4.142 ms
            # against 4.703, llama3-8b FP8 B=256 ctx 1024 10.078 against 10.942. Rings of 3 or 4 were slower, and
            # split launches keep the Triton kernel (the unpacked ring there: qwen3-0.6b B=64 steps 2.013 ms against
            # 1.958)
            return AttentionConfig(num_splits=num_splits, heads_fast=True, fp8_convert="qk_fp8x2",
                                   decode_keys_on_m=True, decode_lazy_sum=True, decode_one_loop=num_splits > 1,
                                   decode_num_stages=1 if num_splits > 1 else 2, decode_pipelined=num_splits == 1)
        # One-warp programs on 16-key tiles (decode_num_warps=1, decode_tile_n=16) were not made the default: H200,
        # 2026-12-04 (bench/results/s22), B=256 llama3-8b / qwen3-0.6b, 1105 / 1097 us a layer at context 4096
        # against 953 / 947; at 512-1024 within the timing's noise of the 4-warp launch.
        # Split launches run every tile in one masked loop, fp8 or not (decode_one_loop: a split holds a few tiles, and
        # the partial tile's own loop waited a memory round trip of its own): B=1, contexts 512-768 / 1024 / 4096,
        # bf16 6.6-6.7 / 7.7 / 11.7-11.9 us a layer against 6.8-6.9 / 8.1 / 12.1-12.3, fp8 6.8-6.9 / 7.4-7.6 /
        # 10.2-10.4 against 6.8-7.0 / 7.7-7.8 / 10.4-10.6 (qwen3-0.6b and llama3-8b, H200, 2026-12-04,
        # bench/results/s23); unsplit (B=64, 256) the longer masked loop lost 1-6% (fp8) and was level (bf16)
        return AttentionConfig(num_splits=num_splits, heads_fast=True, decode_one_loop=num_splits > 1)
    mostly_decode = num_seqs * max_query_len > 2 * num_tokens  # the mean query is far shorter than the longest
    # the decode rows of steps with chunks, over an fp8 cache: the decode-only launch's conversion
    # (Triton's launch: with the Gluon kernel for these rows too, qwen3-0.6b's fp8-cache reference run measured 42,530
    # out tok/s against 44,771 without, H200 2026-12-04, two calls; not separated from run-to-run spread, so not kept)
    decode_rows = _FP8_DECODE_ROWS if fp8_kv else {}
    if max_query_len * group_size >= 128 and not mostly_decode:
        if fp8_kv and max_query_len <= FP8_SHORT_CHUNK:  # H200: q in registers, 64-key tiles, no cap (see above)
            return AttentionConfig(num_splits=num_splits, prefill_tile_n=64, fp8_q_staged=False, **decode_rows)
        if fp8_kv:  # staged q, 64-key tiles (H200 2026-12-03, see above)
            return AttentionConfig(num_splits=num_splits, prefill_tile_n=64,
                                   prefill_max_regs=128 if head_dim <= 128 else 0, **decode_rows)
        return AttentionConfig(num_splits=num_splits)
    return AttentionConfig(num_splits=num_splits, prefill_block_m=64, prefill_tile_n=64, prefill_num_warps=4,
                           prefill_num_stages=2, **decode_rows)


@triton.jit
def softmax_tile(s, m_i, KEYS_AXIS: tl.constexpr):
    """One key tile of the running (base-2) softmax: s holds the tile's scores with the keys along KEYS_AXIS
    (1: [M, N], 0: [N, M] for transposed dots); returns (p, alpha, m_new), p = exp2(s - m_new) and alpha the factor
    that rescales what was accumulated before this tile. The running sum is the caller's (online_softmax_step, or
    kept per key slot: decode_lazy_sum)."""
    m_new = tl.maximum(m_i, tl.max(s, KEYS_AXIS))  # [M]
    alpha = tl.exp2(m_i - m_new)
    if KEYS_AXIS == 1:
        p = tl.exp2(s - m_new[:, None])
    else:
        p = tl.exp2(s - m_new[None, :])
    return p, alpha, m_new


@triton.jit
def online_softmax_step(s, m_i, l_i, KEYS_AXIS: tl.constexpr):
    """softmax_tile with the running sum l_i [M]: (p, alpha, m_new, l_new)."""
    p, alpha, m_new = softmax_tile(s, m_i, KEYS_AXIS)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, KEYS_AXIS)


@triton.jit
def softmax_sums_init(LAZY_SUM: tl.constexpr, KEYS_ON_M: tl.constexpr, TILE_N: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """The running softmax sums before the first tile: [BLOCK_M], or with LAZY_SUM one per key slot of a tile,
    [TILE_N, BLOCK_M] (keys on M) or [BLOCK_M, TILE_N]; softmax_sums_total reduces them after the last tile."""
    if LAZY_SUM and KEYS_ON_M:
        return tl.zeros([TILE_N, BLOCK_M], tl.float32)
    elif LAZY_SUM:
        return tl.zeros([BLOCK_M, TILE_N], tl.float32)
    else:
        return tl.zeros([BLOCK_M], tl.float32)


@triton.jit
def softmax_sums_total(l_i, LAZY_SUM: tl.constexpr, KEYS_ON_M: tl.constexpr):
    """[BLOCK_M] softmax sums from what softmax_sums_init started and the tiles kept."""
    if LAZY_SUM:
        return tl.sum(l_i, 0 if KEYS_ON_M else 1)
    else:
        return l_i


@triton.jit
def grid_position(HEADS_FAST: tl.constexpr):
    """(query program, head block, number of query programs, split) of this program: the grid is (query
    programs, head blocks, splits), the first two swapped with HEADS_FAST (one sequence's heads scheduled
    together)."""
    if HEADS_FAST:
        pid = tl.program_id(1)
        head = tl.program_id(0)
        num_q_programs = tl.num_programs(1)
    else:
        pid = tl.program_id(0)
        head = tl.program_id(1)
        num_q_programs = tl.num_programs(0)
    return pid, head, num_q_programs, tl.program_id(2)


@triton.jit
def key_tile_range(context_len, q_lo, q_len, split, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr):
    """The keys one program attends to for query rows [q_lo, q_lo + BLOCK_Q) of a sequence with context_len cached
    tokens: (kv_end, tiles every row sees whole, this split's first tile, its end tile)."""
    last_q = tl.minimum(q_lo + BLOCK_Q, q_len) - 1
    kv_end = tl.maximum(context_len + last_q + 1, 0)
    num_full = tl.maximum(context_len + q_lo + 1, 0) // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = num_tiles * 0  # a tensor in both branches: a jit helper returns one type
        tile_hi = num_tiles
    return kv_end, num_full, tile_lo, tile_hi


@triton.jit
def _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_seqs] whose first query tile is <= tile_idx. Sequence b owns tiles
    [qsl[b] // BLOCK_Q + b, ...): the + b is slack for tiles never straddling two sequences, so T // BLOCK_Q + B + 1
    programs cover any batch. b == num_seqs is the padding tail [qsl[num_seqs], num_tokens)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _e4m3_to_f16_bits(x):
    """fp8 e4m3 -> the fp16 of x * 2^-8 by integer ops (sign to bit 15, exponent and mantissa shifted to fp16's
    places; the bias difference 15 - 7 = 8 stays as the factor, also for subnormals). Same shape."""
    bits = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_words_to_f16(words, USE_ASM: tl.constexpr):
    """[R, C] int32 words of 4 e4m3 bytes (little-endian) -> [R, 4 C] fp16 (exact). On the GPU two
    cvt.rn.f16x2.e4m3x2 a word; Triton's interpreter runs no inline asm, so there (USE_ASM=False) each byte goes
    through tl's own cast, with the same values. Converting whole words and joining the halves keeps the tile fp16
    from here on: the compiler cannot sink the conversion past the layout change into the dot operand, where an
    e4m3 V tile would be gathered from shared memory one byte at a time."""
    if USE_ASM:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        e0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        e1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        e2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        e3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    joined = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [R, C, 2, 2]: [r, c, i, j] = byte 2 i + j of word c
    return tl.reshape(joined, [words.shape[0], words.shape[1] * 4])


@triton.jit
def _pin_f16(x, USE_ASM: tl.constexpr):
    """x as is, through an identity the compiler cannot see into ("f16_pinned"); the identity itself under the
    interpreter, which runs no inline asm."""
    if USE_ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)
    return x


@triton.jit
def _quantize_rows_e4m3(x):
    """[R, C] fp32 -> ([R, C] e4m3 codes of x / row_scale, [R] fp32 row_scale = row amax / 448; 1 for a zero row).
    Rounds to nearest even in fp32 arithmetic (e4m3 spacing: 2^(exponent - 3), 2^-9 below the normals, via the
    1.5 * 2^23 add/subtract), so the cast to e4m3 that follows is exact: the same codes on the GPU and in Triton's
    interpreter, whose own fp32 -> e4m3 cast mis-rounds mantissa carries."""
    amax = tl.max(tl.abs(x), 1)  # [R]
    amax = tl.where(amax > 0.0, amax, _E4M3_MAX)  # a zero row (padding) gets scale 1
    row_scale = amax / _E4M3_MAX  # [R]
    inv_scale = _E4M3_MAX / amax  # [R]; a product below, not a per-element division
    y = tl.minimum(tl.maximum(x * inv_scale[:, None], -_E4M3_MAX), _E4M3_MAX)  # [R, C], |y| <= 448
    return _to_e4m3(y, False), row_scale


@triton.jit
def _to_e4m3(y, USE_ASM: tl.constexpr):
    """fp32 with |y| <= 448 -> e4m3, round to nearest even. On the GPU the hardware cast (USE_ASM); in Triton's
    interpreter, whose own cast mis-rounds mantissa carries, (and for q, once per program) by fp32 arithmetic: the
    e4m3 spacing at |y| is 2^(exponent - 3), 2^-9 below the normals; adding and subtracting 1.5 * 2^23 rounds
    |t| < 2^22 to the nearest even integer, so the final cast is exact."""
    if USE_ASM:
        return y.to(tl.float8e4nv)
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased fp32 exponent of |y|
    spacing = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)  # >= 2^-9
    magic = 12582912.0  # 1.5 * 2^23
    return (((y / spacing + magic) - magic) * spacing).to(tl.float8e4nv)


@triton.jit
def zext_index(x):
    """A non-negative 32-bit index (a block id or a block's byte stride, each < 2^31) widened to int64 by zero
    extension: the product of two such values compiles to one wide 32 x 32 multiply-add an address (sm_90 SASS of the
    fp8 decode loop: 354 -> 328 instructions) where sign-extended ones took a full 64-bit multiply."""
    return x.to(tl.uint32).to(tl.int64)


@triton.jit
def _load_words_f16(cache_ptr, block, slot, kv_head, stride_b, stride_s, stride_h, key_mask,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, MASKED: tl.constexpr, USE_ASM: tl.constexpr):
    """One K or V tile of an e4m3 cache read as int32 words and converted in the load's layout:
    [TILE_N, HEAD_DIM_P] fp16. Byte strides are multiples of 4 (the wrapper checks)."""
    offs_w = tl.arange(0, HEAD_DIM_P // 4)
    row_ptr = cache_ptr + kv_head * stride_h + block[:, None] * stride_b + slot[:, None] * stride_s  # [TILE_N, 1]
    ptrs = row_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + offs_w[None, :]  # [TILE_N, HEAD_DIM_P // 4]
    if MASKED or HEAD_DIM != HEAD_DIM_P:
        words = tl.load(ptrs, mask=key_mask[:, None] & (offs_w < HEAD_DIM // 4)[None, :], other=0)
    else:
        words = tl.load(ptrs)
    return _e4m3_words_to_f16(words, USE_ASM)


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_lo, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  qk_scale, qk_scale_lo, row_pos, kv_end, tile_lo, tile_hi,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_MODE: tl.constexpr,
                  USE_ASM: tl.constexpr, KEYS_ON_M: tl.constexpr, LAZY_SUM: tl.constexpr, UNROLL: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi). MASKED=False tiles lie wholly below every row's causal
    limit, so they skip the key, causal and block-table masks (the common case; loads stay vectorised). Byte tiles
    a word mode does not use are dead code the compiler drops. q_lo, qk_scale_lo: "qk_fp8x2"'s second term of q
    (unused otherwise). LAZY_SUM: l_i is [TILE_N, BLOCK_M] ([BLOCK_M, TILE_N] with the keys on N), per key slot,
    summed by the caller after the last tile. UNROLL: key tiles an iteration of the compiled loop."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    stride_kb = zext_index(stride_kb)
    stride_vb = zext_index(stride_vb)
    for j in tl.range(tile_lo, tile_hi, loop_unroll_factor=UNROLL):
        key = j * TILE_N + offs_n  # [TILE_N] absolute key positions
        slot = key % BLOCK_SIZE
        k_off_d = kv_head * stride_kh + offs_d[None, :]
        v_off_d = kv_head * stride_vh + offs_d[None, :]
        if MASKED:
            key_mask = key < kv_end
            block = zext_index(tl.load(block_table_row + key // BLOCK_SIZE, mask=key_mask, other=0))  # [TILE_N]
            kv_mask = key_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + k_off_d,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + v_off_d,
                        mask=kv_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
        else:
            block = zext_index(tl.load(block_table_row + key // BLOCK_SIZE))  # [TILE_N]
            if HEAD_DIM == HEAD_DIM_P:
                k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + k_off_d)
                v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + v_off_d)
            else:
                k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + k_off_d,
                            mask=d_mask[None, :], other=0.0)
                v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + v_off_d,
                            mask=d_mask[None, :], other=0.0)
        # Dot operands stay in the storage dtype (tensor-core inputs); products accumulate in fp32 and all the
        # softmax arithmetic below is fp32. Scores are in log2 units: qk_scale = scale * log2(e), so exp2 works.
        # An fp8 cache: to the dot dtype (FP8_CONVERTS); its scales are folded into qk_scale and the output.
        if (FP8_MODE >= 4 and FP8_MODE <= 6) or FP8_MODE == 9:  # word modes and "qk_fp8(x2)": V (and K) as words,
            key_mask = key < kv_end  # fp16 before any layout change; "qk_fp8" leaves K as loaded (e4m3 operand)
            v = _load_words_f16(v_cache_ptr, block, slot, kv_head, stride_vb, stride_vs, stride_vh, key_mask,
                                HEAD_DIM, HEAD_DIM_P, MASKED, USE_ASM)  # [TILE_N, HEAD_DIM_P]
            if FP8_MODE == 4:
                k = _load_words_f16(k_cache_ptr, block, slot, kv_head, stride_kb, stride_ks, stride_kh, key_mask,
                                    HEAD_DIM, HEAD_DIM_P, MASKED, USE_ASM)  # [TILE_N, HEAD_DIM_P]
            elif FP8_MODE == 5:
                k = k.to(tl.float16)
        if FP8_MODE == 1:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        elif FP8_MODE == 2:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        elif FP8_MODE == 8:
            k = _pin_f16(k.to(tl.float16), USE_ASM)
            v = _pin_f16(v.to(tl.float16), USE_ASM)
        elif FP8_MODE == 3:
            k = _e4m3_to_f16_bits(k)
            v = _e4m3_to_f16_bits(v)
        if KEYS_ON_M:  # transposed: the keys fill the dots' M rows, the few query rows are the N columns
            if FP8_MODE == 6 or FP8_MODE == 7:  # e4m3 x e4m3 -> fp32; qk_scale is per query row
                s_t = tl.dot(k, tl.trans(q), out_dtype=tl.float32) * qk_scale[None, :]  # [TILE_N, BLOCK_M]
            elif FP8_MODE == 9:  # q's two e4m3 terms against the same K tile
                s_t = (tl.dot(k, tl.trans(q), out_dtype=tl.float32) * qk_scale[None, :]
                       + tl.dot(k, tl.trans(q_lo), out_dtype=tl.float32) * qk_scale_lo[None, :])  # [TILE_N, BLOCK_M]
            else:
                s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [TILE_N, BLOCK_M]
            if MASKED:
                s_t = tl.where(key[:, None] <= row_pos[None, :], s_t, float("-inf"))
            if LAZY_SUM:
                p_t, alpha, m_new = softmax_tile(s_t, m_i, 0)  # p_t [TILE_N, BLOCK_M]
                l_i = l_i * alpha[None, :] + p_t  # [TILE_N, BLOCK_M]
            else:
                p_t, alpha, m_new, l_i = online_softmax_step(s_t, m_i, l_i, 0)  # p_t [TILE_N, BLOCK_M]
            acc = acc * alpha[None, :]
            if FP8_MODE == 7:  # e4m3 V as loaded x e4m3 p * 2^8
                acc = tl.dot(tl.trans(v), _to_e4m3(p_t * _P_E4M3_MULT, USE_ASM), acc,
                             out_dtype=tl.float32)  # [HEAD_DIM_P, BLOCK_M]
            else:
                acc = tl.dot(tl.trans(v), p_t.to(v.dtype), acc,
                             input_precision=DOT_PRECISION)  # [HEAD_DIM_P, BLOCK_M]
        else:
            if FP8_MODE == 6 or FP8_MODE == 7:  # e4m3 x e4m3 -> fp32; qk_scale is per query row
                s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * qk_scale[:, None]  # [BLOCK_M, TILE_N]
            elif FP8_MODE == 9:  # q's two e4m3 terms against the same K tile
                s = (tl.dot(q, tl.trans(k), out_dtype=tl.float32) * qk_scale[:, None]
                     + tl.dot(q_lo, tl.trans(k), out_dtype=tl.float32) * qk_scale_lo[:, None])  # [BLOCK_M, TILE_N]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
            if MASKED:
                s = tl.where(key[None, :] <= row_pos[:, None], s, float("-inf"))
            if LAZY_SUM:
                p, alpha, m_new = softmax_tile(s, m_i, 1)  # p [BLOCK_M, TILE_N]
                l_i = l_i * alpha[:, None] + p  # [BLOCK_M, TILE_N]
            else:
                p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i, 1)  # p [BLOCK_M, TILE_N]
            acc = acc * alpha[:, None]
            if FP8_MODE == 7:  # e4m3 p * 2^8 x e4m3 V as loaded
                acc = tl.dot(_to_e4m3(p * _P_E4M3_MULT, USE_ASM), v, acc,
                             out_dtype=tl.float32)  # [BLOCK_M, HEAD_DIM_P]
            else:
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM_P]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _stage_rows(q, out_ptr, row_token, row_head, row_valid, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                HEAD_DIM_P: tl.constexpr):
    """q [BLOCK_M, HEAD_DIM_P] (fp16 or e4m3, computed by this program) stored to this program's own output rows
    (a 16-bit row of HEAD_DIM elements holds it: e4m3 fills its first half) and loaded back after a barrier: the
    same values, now a loaded tensor, which the compiler puts in shared memory for the dots instead of registers.
    The rows belong to this program alone and are overwritten by its result (needs NUM_SPLITS == 1)."""
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    row_off = row_token[:, None] * stride_ot + row_head[:, None] * stride_oh  # [BLOCK_M, 1] in 16-bit elements
    if q.dtype == tl.float16:
        ptrs = out_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + row_off + offs_d[None, :]
    else:  # e4m3: byte offsets
        ptrs = out_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True) + 2 * row_off + offs_d[None, :]
    tl.store(ptrs, q, mask=mask)
    tl.debug_barrier()  # every thread's stores are visible to the CTA's loads
    return tl.load(ptrs, mask=mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P]


@triton.jit
def _store_empty_split(part_max_ptr, part_sum_ptr, row_token, row_head, row_valid, split,
                       NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A split with no key tile for these rows: only its (max, sum) = (NEG_BIG, 0), which tell the reduce to skip
    its partial output (never written: ~130x fewer bytes than an all-zero partial). Under CUDA graphs the split
    count follows max_model_len, so at short contexts most splits are empty."""
    part_row = (row_token * NUM_HEADS + row_head) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(part_max_ptr + part_row, tl.full(row_token.shape, _NEG_BIG, tl.float32), mask=row_valid)
    tl.store(part_sum_ptr + part_row, tl.zeros(row_token.shape, tl.float32), mask=row_valid)


@triton.jit
def _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, acc, l_i, m_i, row_token, row_head, row_valid,
                split, stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Write finished rows to out, or with split-KV their unnormalised partials (acc, max, sum), which the
    reduce kernel rescales to the global max. Rows that saw no key (padding) come out zero either way."""
    offs_d = tl.arange(0, HEAD_DIM_P)
    if NUM_SPLITS > 1:
        part_row = (row_token * NUM_HEADS + row_head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row_token[:, None] * stride_ot + row_head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])


# num_seqs, num_tokens and the block table's width (stride_bt) change from step to step: left unspecialised,
# they compile no new variant mid-serving (a prefix-cached batch's width once cost a 1.3 s compile on an H200)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr, k_scale_ptr, v_scale_ptr,
        qk_scale, num_seqs, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, SKIP_DECODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FP8_MODE: tl.constexpr, HEADS_FAST: tl.constexpr, USE_ASM: tl.constexpr, KEYS_ON_M: tl.constexpr,
        Q_STAGED: tl.constexpr, USE_PDL: tl.constexpr, LAZY_SUM: tl.constexpr = False, UNROLL: tl.constexpr = 1,
        ONE_LOOP: tl.constexpr = False):
    """One program: BLOCK_Q query tokens x the GROUP query heads of one KV head (rows m = token m // GROUP,
    head m % GROUP), over one split of the keys. Grid: (programs along the queries, kv heads, splits).
    DECODE: program b is sequence b and runs only if its query length is 1 (BLOCK_Q = 1, no search); program
    num_seqs, if launched, zeroes the padding rows past the last sequence. Else: program i is the i-th query tile
    of the flattened batch, found by binary search; SKIP_DECODE leaves length-1 sequences to a DECODE launch.
    HEADS_FAST swaps the first two grid axes (kv heads first), so one sequence's heads are scheduled together.
    FP8_MODE: 0 a cache in q's dtype; else an fp8 cache read as FP8_CONVERTS[FP8_MODE - 1] says. USE_ASM: PTX
    inline asm allowed (not in Triton's interpreter). Q_STAGED (FP8_MODE >= 2, NUM_SPLITS == 1): the converted q
    goes through the program's output rows (_stage_rows) to reach the dots from shared memory. LAZY_SUM: softmax
    sums per key slot, one cross-thread sum after the tiles (AttentionConfig.decode_lazy_sum). ONE_LOOP: every key
    tile through the masked loop (AttentionConfig.decode_one_loop)."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    pid, kv_head, num_q_programs, split = grid_position(HEADS_FAST)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)

    if DECODE:
        b = pid
        if b == num_seqs:  # the padding tail [qsl[B], T): write empty rows, BLOCK_M // GROUP tokens at a time
            zero_acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
            zero_sum = tl.zeros([BLOCK_M], tl.float32)
            empty_max = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
            tail_row_head = kv_head * GROUP + offs_m % GROUP
            for first in range(tl.load(query_start_loc_ptr + num_seqs), num_tokens, BLOCK_M // GROUP):
                tail_token = first + offs_m // GROUP
                tail_valid = (offs_m < (BLOCK_M // GROUP) * GROUP) & (tail_token < num_tokens)
                _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, zero_acc, zero_sum, empty_max,
                            tail_token.to(tl.int64), tail_row_head, tail_valid, split, stride_ot, stride_oh,
                            NUM_HEADS, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS)
            return
        q_start = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
        if q_len != 1:  # longer chunks belong to the tiled launch; empty sequences own no rows
            return
        seq_len = tl.load(seq_lens_ptr + b)
        q_lo = 0
    else:
        # Last tiles first: a sequence's later query tiles attend the most keys, so starting them early shortens
        # the tail of the launch.
        pid = num_q_programs - 1 - pid
        b = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
        is_seq = b < num_seqs  # else: the padding tail past the last sequence, which attends nothing
        q_start = tl.load(query_start_loc_ptr + b)
        q_end = tl.where(is_seq, tl.load(query_start_loc_ptr + b + 1, mask=is_seq, other=0), num_tokens)
        seq_len = tl.load(seq_lens_ptr + b, mask=is_seq, other=0)
        q_lo = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q  # first query of this tile, within the sequence
        q_len = q_end - q_start
        if q_lo >= q_len:
            return
        if SKIP_DECODE:
            if is_seq & (q_len == 1):
                return
    context_len = seq_len - q_len  # cached tokens before this chunk; < 0 only for padding rows

    row_q = q_lo + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    row_head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_valid = (offs_m < BLOCK_Q * GROUP) & (row_q < q_len)
    row_token = (q_start + row_q).to(tl.int64)  # [BLOCK_M] row of q / out
    row_pos = context_len + row_q  # [BLOCK_M] absolute position: attends keys 0..row_pos
    d_mask = offs_d < HEAD_DIM
    # Keys below context_len + q_lo + 1 are visible to every row (no mask); the rest up to the last row's
    # position need the causal mask. Bounds come from the tensors, so a CUDA-graph replay stays right.
    kv_end, num_full, tile_lo, tile_hi = key_tile_range(context_len, q_lo, q_len, split, BLOCK_Q, TILE_N, NUM_SPLITS)
    if NUM_SPLITS > 1:
        if tile_lo >= tile_hi:
            _store_empty_split(part_max_ptr, part_sum_ptr, row_token, row_head, row_valid, split, NUM_HEADS,
                               NUM_SPLITS)
            return
    q = tl.load(q_ptr + row_token[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P]

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    if KEYS_ON_M:
        acc = tl.zeros([HEAD_DIM_P, BLOCK_M], tl.float32)  # transposed until the tiles are done
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    l_i = softmax_sums_init(LAZY_SUM, KEYS_ON_M, TILE_N, BLOCK_M)
    if FP8_MODE != 0:  # scores = q . (k_fp8 * k_scale): fold the per-tensor scale into the softmax scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    q_lo = q  # "qk_fp8x2"'s second term; unused by the other modes
    qk_scale_lo = qk_scale
    if FP8_MODE == 6 or FP8_MODE == 7 or FP8_MODE == 9:  # e4m3 q rows with their own scales: qk_scale [BLOCK_M]
        q32 = q.to(tl.float32)
        q, q_row_scale = _quantize_rows_e4m3(q32)
        if FP8_MODE == 9:  # the rounding error of that q, quantized the same way: q ~= hi * s_hi + lo * s_lo
            q_lo, q_lo_scale = _quantize_rows_e4m3(q32 - q.to(tl.float32) * q_row_scale[:, None])
            qk_scale_lo = qk_scale * q_lo_scale
        qk_scale = qk_scale * q_row_scale
    elif FP8_MODE >= 2:  # fp16 dots: q scaled once so its amax is _F16_Q_AMAX, the inverse folded into qk_scale
        q32 = q.to(tl.float32)
        q_mult = _F16_Q_AMAX / tl.maximum(tl.max(tl.max(tl.abs(q32), 1), 0), 1.0e-30)
        q = (q32 * q_mult).to(tl.float16)
        qk_scale = qk_scale / q_mult
        if FP8_MODE == 3:  # f16_bits keys are e4m3 * 2^-8
            qk_scale = qk_scale * 256.0
    if Q_STAGED:
        q = _stage_rows(q, out_ptr, row_token, row_head, row_valid, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P)
    block_table_row = block_tables_ptr + b.to(tl.int64) * stride_bt  # never read for the padding tail
    # ONE_LOOP (decode): every tile through the masked loop; else the whole tiles unmasked, then the partial one
    masked_lo = tile_lo if ONE_LOOP else tl.maximum(tile_lo, num_full)
    if not ONE_LOOP:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_lo, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
                                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                      qk_scale, qk_scale_lo, row_pos, kv_end, tile_lo, tl.minimum(tile_hi, num_full),
                                      HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, False, DOT_PRECISION, FP8_MODE,
                                      USE_ASM, KEYS_ON_M, LAZY_SUM, UNROLL)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_lo, k_cache_ptr, v_cache_ptr, block_table_row, kv_head,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                  qk_scale, qk_scale_lo, row_pos, kv_end, masked_lo, tile_hi,
                                  HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, True, DOT_PRECISION, FP8_MODE, USE_ASM,
                                  KEYS_ON_M, LAZY_SUM, UNROLL)
    l_i = softmax_sums_total(l_i, LAZY_SUM, KEYS_ON_M)  # [BLOCK_M]
    if KEYS_ON_M:
        acc = tl.trans(acc)  # [BLOCK_M, HEAD_DIM_P]
    if FP8_MODE != 0:  # sum_j p_j (v_fp8_j * v_scale) = v_scale * sum_j p_j v_fp8_j (also for split partials)
        v_scale = tl.load(v_scale_ptr)
        if FP8_MODE == 3:  # f16_bits values are e4m3 * 2^-8
            v_scale = v_scale * 256.0
        if FP8_MODE == 7:  # p went into the dots times 2^8
            v_scale = v_scale / _P_E4M3_MULT
        acc = acc * v_scale

    _store_rows(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, acc, l_i, m_i, row_token, row_head, row_valid,
                split, stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS)


@triton.jit
def _split_reduce_kernel(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, USE_PDL: tl.constexpr):
    """Merge the NUM_SPLITS partial softmaxes of one (token, head). Grid: (tokens, heads). A split whose max is
    NEG_BIG saw no key: its partial output is not read (an empty split does not write it)."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    s_mask = offs_s < NUM_SPLITS
    part_row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [SPLITS_P]
    part_max = tl.load(part_max_ptr + part_row, mask=s_mask, other=float("-inf"))  # [SPLITS_P]
    part_sum = tl.load(part_sum_ptr + part_row, mask=s_mask, other=0.0)
    has_keys = s_mask & (part_max > _NEG_BIG)  # [SPLITS_P]
    acc = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM_P + offs_d[None, :], mask=has_keys[:, None],
                  other=0.0)  # [SPLITS_P, HEAD_DIM_P]
    weight = tl.exp2(part_max - tl.max(part_max, 0))  # [SPLITS_P]; the max is >= NEG_BIG, finite
    total = tl.sum(part_sum * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [HEAD_DIM_P]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def split_partials(out: torch.Tensor, num_tokens: int, num_heads: int, num_splits: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-KV partials (out [T, heads, splits, width] fp32, running max and sum [T, heads, splits]); one split
    writes none: out stands in for all three (never read)."""
    if num_splits == 1:
        return out, out, out
    part_out = torch.empty((num_tokens, num_heads, num_splits, width), dtype=torch.float32, device=out.device)
    part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor | None) -> None:
    """ValueError on anything the kernels rely on; messages are built only on failure (this runs every step)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"heads {num_heads} must be a multiple of kv_heads {num_kv_heads}")
    if not 0 < head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{_MAX_HEAD_DIM}, got {head_dim}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} is not a float type")
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must have q's dtype {q.dtype} or both be float8_e4m3fn, got {k_cache.dtype} "
                         f"and {v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    check_batch_layout(block_tables, seq_lens, query_start_loc)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} contiguous along head_dim, got "
                         f"{tuple(out.shape)} {out.dtype}")
    device = q.device
    if (k_cache.device != device or v_cache.device != device or block_tables.device != device
            or seq_lens.device != device or query_start_loc.device != device
            or (out is not None and out.device != device)):
        raise ValueError("all tensors must be on q's device " + str(device))


def _fp8_mode(fp8_kv: bool, q_dtype: torch.dtype, convert: str, head_dim: int, k_cache: torch.Tensor,
              v_cache: torch.Tensor, key_tile: int) -> int:
    """The kernel's FP8_MODE: 0 without an fp8 cache; with an fp32 q always "native" (fp16 dots would round it);
    the word modes fall back to "f16" where a row of head_dim bytes is not made of whole aligned words; the fp8
    tensor-core modes to "f16_words" below 32 (padded) dims, the fp8 MMA's K, and "qkv_fp8" to "qk_fp8" where the
    launch's key tile (key_tile), its PV dot's K, is below 32 (sm_90 rejects such an fp8 dot at compile time:
    "K >= 32"; the interpreter does not). Decided per launch: convert is that launch's FP8_CONVERTS entry."""
    if not fp8_kv:
        return 0
    if q_dtype == torch.float32:
        convert = "native"
    if convert in _FP8_MMA_CONVERTS and triton.next_power_of_2(head_dim) < 32:
        convert = "f16_words"
    if convert == "qkv_fp8" and key_tile < 32:
        convert = "qk_fp8"
    if convert in ("f16_words", "f16_vwords", *_FP8_MMA_CONVERTS) and not _word_aligned(head_dim, k_cache, v_cache):
        convert = "f16"
    return _FP8_MODE[convert]


def _keys_on_m(keys_on_m: bool, convert: str, fp8_mode: int) -> bool:
    """Decode dots with the keys on M as configured (keys_on_m), except where an fp8 tensor-core mode was asked for
    (convert; it sets keys on M for wgmma) and _fp8_mode fell back to a conversion (transposed dots only slow
    those)."""
    fell_back = (convert in _FP8_MMA_CONVERTS and fp8_mode != 0  # 0: a 16-bit cache
                 and fp8_mode not in _FP8_MMA_MODES)
    return keys_on_m and not fell_back


def _word_aligned(head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (head_dim % 4 == 0 and all(stride % 4 == 0 for stride in (*k_cache.stride()[:3], *v_cache.stride()[:3]))
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def _fp8_decode_override(config: AttentionConfig) -> AttentionConfig:
    """PAGODA_FP8_KV_DECODE=<an FP8_CONVERTS mode> (a measurement switch, read at every launch so that
    bench/step_ab.py can A/B it in one process): decode-only steps over an fp8 cache convert that way, with the keys
    on the dots' M rows for the fp8 tensor-core modes (qk_fp8, qk_fp8x2, qkv_fp8), which need them for wgmma.
    PAGODA_FP8_DECODE_PIPELINED=0 / 1 / 2-4 (the same kind of switch) turns the Gluon decode kernel
    (decode_pipelined) off, on (at least two ring slots), or on with that many ring slots."""
    pipelined = measurement_switch("FP8_DECODE_PIPELINED")
    if pipelined:
        if pipelined == "0":
            config = replace(config, decode_pipelined=False)
        else:
            stages = max(2, config.decode_num_stages) if pipelined == "1" else int(pipelined)
            config = replace(config, decode_pipelined=True, decode_num_stages=stages)
    convert = measurement_switch("FP8_KV_DECODE")
    if not convert:
        return config
    if convert not in FP8_CONVERTS:
        raise ValueError(f"PAGODA_FP8_KV_DECODE must be one of {FP8_CONVERTS}, got {convert!r}")
    return replace(config, fp8_convert=convert, decode_keys_on_m=convert.startswith("qk"))


def _check_config(config: AttentionConfig) -> None:
    for name in ("decode_tile_n", "prefill_block_m", "prefill_tile_n"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if not 1 <= config.decode_unroll <= 4:
        raise ValueError(f"decode_unroll must be in 1..4, got {config.decode_unroll}")
    if not 1 <= config.num_splits <= 64:
        raise ValueError(f"num_splits must be in 1..64, got {config.num_splits}")
    for name in ("prefill_max_regs", "decode_max_regs"):
        value = getattr(config, name)
        if value and not 32 <= value <= 255:
            raise ValueError(f"{name} must be 0 or in 32..255, got {value}")
    if config.fp8_convert not in FP8_CONVERTS:
        raise ValueError(f"fp8_convert must be one of {FP8_CONVERTS}, got {config.fp8_convert!r}")
    if config.decode_fp8_convert not in ("", *FP8_CONVERTS):
        raise ValueError(f"decode_fp8_convert must be '' or one of {FP8_CONVERTS}, got {config.decode_fp8_convert!r}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, heads, head_dim] over the paged caches [num_blocks, block_size, kv_heads,
    head_dim]; semantics of reference.paged_attention. Sequence b's queries are rows [qsl[b], qsl[b+1]) and are
    the last ones of its seq_lens[b] tokens, whose K/V are already in the caches. Rows of sequences with
    seq_lens[b] == 0 and rows past qsl[B] (padding) come out zero. Not checked (it would cost a device sync):
    qsl is non-decreasing with qsl[B] <= T, seq_lens[b] >= query length, block_tables covers seq_lens.
    max_query_len and max_seq_len are upper bounds that pick the launch shape only. Returns out [T, heads, D].
    An fp8 (e4m3) cache needs k_scale, v_scale [1] fp32: it holds k / k_scale and v / v_scale; with a 16-bit q its
    tiles reach the dots as config.fp8_convert says (default fp16 operands; an fp32 q upcasts them to fp32).

    Launches: one DECODE launch (a program per (sequence, kv head, split) for length-1 queries); if
    max_query_len > 1 also a tiled launch for the longer chunks; with num_splits > 1 a reduce launch."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    if fp8_kv and not all(s is not None and s.shape == (1,) and s.dtype == torch.float32 and s.device == q.device
                          for s in (k_scale, v_scale)):
        raise ValueError("an fp8 cache needs k_scale and v_scale as [1] fp32 tensors on q's device")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [T, heads, D]
    if num_tokens == 0:
        return out
    if config is None:
        num_sms = _num_sms(q.device.index or 0) if q.is_cuda else 132
        config = pick_config(num_tokens, num_seqs, num_kv_heads, group, max_query_len, max_seq_len, num_sms, fp8_kv,
                             head_dim)
        if fp8_kv and max_query_len <= 1:
            config = _fp8_decode_override(config)
    else:
        _check_config(config)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    num_splits = config.num_splits
    part_out, part_max, part_sum = split_partials(out, num_tokens, num_heads, num_splits, head_dim_p)
    args = (out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_out, part_max, part_sum,
            k_scale if fp8_kv else out, v_scale if fp8_kv else out,
            scale * _LOG2E, num_seqs, num_tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    decode_only = max_query_len <= 1
    # each launch's fp8 conversion; the decode rows' may differ (decode_fp8_convert)
    decode_convert = config.decode_fp8_convert or config.fp8_convert
    decode_fp8_mode = _fp8_mode(fp8_kv, q.dtype, decode_convert, head_dim, k_cache, v_cache, config.decode_tile_n)
    tiled_fp8_mode = _fp8_mode(fp8_kv, q.dtype, config.fp8_convert, head_dim, k_cache, v_cache, config.prefill_tile_n)
    shape = dict(NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
                 NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                 HEADS_FAST=config.heads_fast, USE_ASM=not triton_interpreted())

    pdl_options = pdl.launch_options(q.device)

    def grid(num_q_programs: int) -> tuple[int, int, int]:
        if config.heads_fast:
            return (num_kv_heads, num_q_programs, num_splits)
        return (num_q_programs, num_kv_heads, num_splits)

    # Decode rows: the G heads of one token on the M dim of tl.dot, padded to >= 16 rows. In a decode-only
    # batch one extra program zeroes the padding rows past qsl[B]; otherwise the tiled launch does.
    num_decode_programs = num_seqs + 1 if decode_only else num_seqs
    pipelined = (config.decode_pipelined and decode_fp8_mode == _FP8_MODE["qk_fp8x2"]
                 and fp8_decode_gluon.supports(q, head_dim, group, config.decode_tile_n, config.decode_num_stages))
    if num_decode_programs and pipelined and fp8_decode_gluon.launch(
            (num_kv_heads, num_decode_programs, num_splits), args, NUM_HEADS=num_heads, GROUP=group,
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(group)),
            TILE_N=config.decode_tile_n, NUM_SPLITS=num_splits, STAGES=config.decode_num_stages,
            PACKED=group <= 8 and config.decode_packed, num_warps=fp8_decode_gluon.NUM_WARPS.value, **pdl_options):
        pass  # the Gluon kernel ran
    elif num_decode_programs:
        _paged_attention_kernel[grid(num_decode_programs)](
            *args, **shape, BLOCK_Q=1, BLOCK_M=max(16, triton.next_power_of_2(group)), TILE_N=config.decode_tile_n,
            DECODE=True, SKIP_DECODE=False, Q_STAGED=False,
            KEYS_ON_M=_keys_on_m(config.decode_keys_on_m, decode_convert, decode_fp8_mode),
            FP8_MODE=decode_fp8_mode, LAZY_SUM=config.decode_lazy_sum, UNROLL=config.decode_unroll,
            ONE_LOOP=config.decode_one_loop,
            num_warps=config.decode_num_warps, num_stages=config.decode_num_stages,
            **({"maxnreg": config.decode_max_regs} if config.decode_max_regs and q.dtype != torch.float32 else {}),
            **pdl_options)
    if not decode_only:
        block_m = max(config.prefill_block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        num_q_tiles = num_tokens // block_q + num_seqs + 1  # bounds every sequence's tiles plus the padding tail
        _paged_attention_kernel[grid(num_q_tiles)](
            *args, **shape, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=config.prefill_tile_n,
            DECODE=False, SKIP_DECODE=True, KEYS_ON_M=False, FP8_MODE=tiled_fp8_mode,
            Q_STAGED=(config.fp8_q_staged and tiled_fp8_mode >= 2 and tiled_fp8_mode != _FP8_MODE["qk_fp8x2"]
                      and num_splits == 1),
            num_warps=config.prefill_num_warps, num_stages=config.prefill_num_stages,
            **({"maxnreg": config.prefill_max_regs} if config.prefill_max_regs and q.dtype != torch.float32 else {}),
            **pdl_options)
    if num_splits > 1:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_max, part_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits), num_warps=4,
            **pdl_options)
    return out
