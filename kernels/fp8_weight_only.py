"""Weight-only FP8 (W8A16) linear layers for small token counts (decode up to ~32 rows): the e4m3 weights are
read once, converted in registers and multiplied with the bf16/fp16 activations as they are; the per-channel (or
per-group) weight scales are applied to the fp32 partial sums, never to the weight tile. No activation
quantization: at batch 1 the layer is a pure weight read, and a quantize kernel before it is pure overhead.
Semantics: reference.fp8_weight_only_linear.

Launch shape per (M, N, K): a tile of BLOCK_N output channels per program, optional split-K over SPLIT_K
programs whose fp32 partials a second small kernel sums (with the bias and the cast), and either tensor-core
dots (rows padded to 16) or FMA reductions for 1-8 rows; tensor-core tiles may also quantize the activation
tile they load (act_fp8: W8A8 on fp8 tensor cores with no quantize kernel, scales per row and BLOCK_K columns;
the tuner's candidates at every M bucket). Tuned per shape and M bucket on the GPU by
`python -m pagoda.bench.fp8_tune` into fp8_configs/*.json (keyed by device and Triton version); default
heuristics otherwise.

Up to three launches fewer a decode layer (models/llama.py): the o and down projections (one device) leave their
split-K partials to the residual add + norm that follows (DeferredSum, norm.add_rms_norm_parts, or
fp8.add_rms_norm_parts_quant_fp8 where that norm quantizes for a W8A8 GEMM), the qkv projection to qkv prep
(qkv_prep.prepare_qkv). PAGODA_FUSE_SPLIT_K=0 keeps the split-K sum kernel, =norms only the norms' fusion (for
measuring; the outputs are bit-identical either way).
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.fp8 import FP8_MIN_AMAX_C, cast_e4m3, hw_cast
from pagoda.shared.config import triton_interpreted

FP8_DTYPE = torch.float8_e4m3fn
CONFIG_DIR = Path(__file__).with_name("fp8_configs")
MAX_ROWS = 256  # the weight-only path serves at most this many tokens; larger M quantizes activations (W8A8)
DEFAULT_MAX_ROWS = 32  # without a tuned entry saying otherwise: W8A16 up to here, W8A8 beyond
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GemvTiles:
    block_m: int = 1  # rows per program; 16 or 32 with use_dot
    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 4
    late_reduce: bool = False  # FMA tiles of one row: reduce over K once at the end (see _w8a16_kernel)
    swap_ab: bool = False  # tensor-core tiles: W tile on the dot's M side (see _w8a16_kernel)
    act_fp8: bool = False  # tensor-core tiles: W8A8 inside the kernel (see _w8a16_kernel ACT_FP8)


@dataclass(frozen=True, slots=True)
class DeferredSum:
    """A layer's output left as terms for the kernel that consumes it to sum (add_rms_norm folds the sum into its
    pass: one launch fewer a layer): a weight-only linear layer's split-K fp32 partial sums (contiguous), or an
    MoE layer's top-k expert outputs in the model dtype (a strided view of its [T, k, N] rows; moe.fused_experts
    with defer_sum). Their sum in fp32, in order, rounded to `dtype`, is the layer's output."""

    parts: torch.Tensor  # [S, M, N], N contiguous
    dtype: torch.dtype  # the output's dtype

    def materialize(self) -> torch.Tensor:
        """The summed output [M, N] in dtype."""
        splits, num_rows, n = self.parts.shape
        if self.parts.dtype != torch.float32 or not self.parts.is_contiguous():
            return self.parts.float().sum(0).to(self.dtype)
        out = torch.empty((num_rows, n), dtype=self.dtype, device=self.parts.device)  # [M, N]
        _launch_split_k_sum(self.parts, out, None)
        return out


@triton.jit
def pow2_scale(amax):
    """(scale, 1 / scale) for fp32 amax >= 0: the smallest power of two with amax / scale <= 448 (amax at least
    FP8_MIN_AMAX), built from amax's exponent and mantissa bits: no division, and x * (1 / scale) is exact, so the
    e4m3 codes are x / scale rounded once (reference.pow2_act_scales)."""
    bits = tl.maximum(amax, FP8_MIN_AMAX_C).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127  # amax = m * 2^exponent, m in [1, 2)
    scale_exp = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 448 = 1.75 * 2^8
    scale = ((scale_exp + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - scale_exp) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit(do_not_specialize=["M"])  # the token count changes every step: one variant for every M
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, bias_ptr, M, N, K,
                  stride_xm, stride_wn, stride_sn, stride_om, stride_ps,
                  GROUP_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                  EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FP32_DOT: tl.constexpr, LATE_REDUCE: tl.constexpr, HAS_SCALE: tl.constexpr,
                  SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr, GATED: tl.constexpr,
                  ACT_FP8: tl.constexpr, HW_CAST: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (n tile, m tile, k split): acc[BLOCK_M, BLOCK_N] = x[rows, k range] @ W[cols, k range]^T in fp32,
    each weight scale applied to its group's partial sum (GROUP_K = 0: one scale per channel, applied at the
    end; HAS_SCALE = False: 16-bit weights, no scales, for gemv.dense_gemv). SPLIT_K == 1 writes out (+ bias);
    else the fp32 partial goes to part[k split, row, col].
    LATE_REDUCE (FMA tiles of one row): products accumulate elementwise in a [BLOCK_N, BLOCK_K] tile reduced over
    K once at the end, instead of a cross-lane reduction every BLOCK_K step.
    SWAP_AB (tensor-core tiles): part^T = W x^T, the converted weight tile as the dot's first operand (Hopper's
    wgmma reads it from registers, where it was converted, instead of a round trip through shared memory) and the
    few token rows on the dot's N side.
    GATED: x is a gated MLP's [gate ‖ up] rows ([M, 2K]); the kernel multiplies silu(gate) * up, computed and
    rounded as activation.silu_and_mul computes it, so one launch replaces that kernel and this one.
    ACT_FP8 (tensor-core tiles, e4m3 weights): W8A8 with the activation quantized where it is loaded, no quantize
    kernel of its own: each [BLOCK_M, BLOCK_K] tile of x is scaled per row by a power of two that brings its amax
    to at most 448 (pow2_scale) and cast to e4m3, the dot runs on fp8 tensor cores with the weight tile as loaded
    (no conversion), and the fp32 product is multiplied by the row scales of that K step (scales per row and
    BLOCK_K columns: reference.fp8_act_tile_linear). Every program of an N column quantizes the same x tiles again
    (they are read from L2)."""
    pdl.launch_dependents(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # a multiple of BLOCK_K (and of GROUP_K: the wrapper checks)
    k_start = pid_k * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BN, BK]
    pdl.wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_wide = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # LATE_REDUCE's elementwise sums
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWAP_AB's transposed sums
    for k0 in range(k_start, k_end, BLOCK_K):
        # x before w: with the loads the other way round, Triton laid the one-row FMA tiles out for a cross-lane
        # reduction at every K step (sm_90 SASS of the llama3-8b o tile: 433 loop instructions against 261, 82
        # SHFL against 20), which made FP8 batch-1 decode 2.78 -> 4.13 ms/token on the H200
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            k_mask = (k0 + offs_k) < k_end
            x_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BM, BK]
        if GATED:  # silu rounded to the storage dtype before the product, as activation.silu_and_mul
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)  # [BN, BK]
        if GROUP_K != 0:
            scale = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)  # [BN]
        if LATE_REDUCE:
            prod = w.to(tl.float32) * tl.sum(x.to(tl.float32), 0)[None, :]  # [BN, BK]; x is one row
            if GROUP_K == 0:
                acc_wide += prod
            else:
                acc_wide += prod * scale[:, None]
        else:
            if ACT_FP8:  # x_scale [BM]: this K step's row scales; x_op e4m3 codes (their fp32 values for FP32_DOT)
                xf = x.to(tl.float32)
                x_scale, x_inverse = pow2_scale(tl.max(tl.abs(xf), 1))  # [BM] each
                x_op = cast_e4m3(xf * x_inverse[:, None], HW_CAST)  # exact scaling, |.| <= 448: no clamp
                w_op = w
                if FP32_DOT:
                    x_op = x_op.to(tl.float32)
                    w_op = w.to(tl.float32)
                if SWAP_AB:
                    part_t = tl.dot(w_op, tl.trans(x_op), input_precision=DOT_PRECISION) * x_scale[None, :]
                    if GROUP_K == 0:
                        acc_t += part_t  # [BN, BM]
                    else:
                        acc_t += part_t * scale[:, None]
                else:
                    part = tl.dot(x_op, tl.trans(w_op), input_precision=DOT_PRECISION) * x_scale[:, None]
            elif USE_DOT:
                if FP32_DOT:  # fp32 activations; or Triton 3.6's interpreter, which multiplies bf16 wrongly
                    w_op = w.to(tl.float32)
                    x_op = x.to(tl.float32)
                else:  # e4m3 -> bf16/fp16 is exact: tensor cores on the activation dtype
                    w_op = w.to(tl.float32).to(x_ptr.dtype.element_ty)
                    x_op = x
                if SWAP_AB:  # accumulated transposed, in the dot itself where no group scale intervenes
                    if GROUP_K == 0:
                        acc_t = tl.dot(w_op, tl.trans(x_op), acc_t, input_precision=DOT_PRECISION)  # [BN, BM]
                    else:
                        acc_t += tl.dot(w_op, tl.trans(x_op), input_precision=DOT_PRECISION) * scale[:, None]
                else:
                    part = tl.dot(x_op, tl.trans(w_op), input_precision=DOT_PRECISION)  # [BM, BN]
            else:
                wf = w.to(tl.float32)
                xf = x.to(tl.float32)
                part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for m in tl.static_range(BLOCK_M):
                    x_row = tl.sum(tl.where(tl.arange(0, BLOCK_M)[:, None] == m, xf, 0.0), 0)  # [BK]
                    row = tl.sum(wf * x_row[None, :], 1)  # [BN]
                    part += tl.where(tl.arange(0, BLOCK_M)[:, None] == m, row[None, :], 0.0)
            if not SWAP_AB:
                if GROUP_K == 0:
                    acc += part
                else:
                    acc += part * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if LATE_REDUCE:
        acc = tl.sum(acc_wide, 1)[None, :]  # [1, BN]
    if SWAP_AB:
        acc = tl.trans(acc_t)  # [BM, BN]
    if GROUP_K == 0 and HAS_SCALE:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * stride_ps + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_sum_kernel(part_ptr, out_ptr, bias_ptr, M, N, stride_om, stride_ps,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """out[m, n] = sum over splits of part[s, m, n] (+ bias[n]), cast to out's dtype; BLOCK elements a program."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    cols = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N).to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_split_k_sum(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] = sum of part [S, M, N] (+ bias), cast to out's dtype."""
    splits, num_rows, n = part.shape
    block = 1024
    _split_k_sum_kernel[(triton.cdiv(num_rows * n, block),)](
        part, out, bias if bias is not None else out, num_rows, n, out.stride(0), part.stride(0),
        SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl.launch_options(part.device))


def default_tiles(num_rows: int, n: int, k: int, group_size: int | None = None) -> GemvTiles:
    """Without a tuned table: FMA rows for 1-4 tokens, tensor-core tiles of 16/32 beyond; narrow N tiles so a
    4096-wide layer still spreads over every SM, split-K when even those are too few programs."""
    use_dot = num_rows > 4
    block_m = max(16, min(32, triton.next_power_of_2(num_rows))) if use_dot else triton.next_power_of_2(num_rows)
    block_n = 16 if not use_dot else 32
    block_k = min(512 if not use_dot else 256, group_size or triton.next_power_of_2(k))  # a power of two
    programs = triton.cdiv(n, block_n)
    split_k = 1
    while programs * split_k < 256 and k % (block_k * split_k * 2) == 0 and split_k < 8:
        split_k *= 2
    return GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot,
                     num_warps=4, num_stages=4)


def config_name(device: str) -> str:
    return f"w8a16,device={device},triton={triton.__version__}.json"


def tiles_to_json(tiles: GemvTiles) -> dict[str, Any]:
    return asdict(tiles)


def tiles_from_json(entry: dict[str, Any]) -> GemvTiles:
    return GemvTiles(**{key: entry[key] for key in GemvTiles.__dataclass_fields__ if key in entry})


@functools.lru_cache(maxsize=4)
def _read_table(device: str) -> dict[tuple[int, int, int], dict[str, Any]]:
    """{(N, K, M bucket): entry} from fp8_configs/ for this device and Triton version; {} when none. An entry is
    a GemvTiles dict, or {"w8a8": true} where the sweep measured the quantized-activation GEMM faster."""
    path = CONFIG_DIR / config_name(device.replace(" ", "_"))
    if not path.exists():
        log.info("no tuned W8A16 tiles for %s (%s): default tiles", device, path.name)
        return {}
    raw = json.loads(path.read_text())
    return {tuple(int(part) for part in key.split(",")): entry for key, entry in raw.items()}  # type: ignore[misc]


@functools.lru_cache(maxsize=4)
def tuned_table(device: str) -> dict[tuple[int, int, int], GemvTiles]:
    return {key: tiles_from_json(entry) for key, entry in _read_table(device).items() if not entry.get("w8a8")}


@functools.lru_cache(maxsize=4)
def w8a8_buckets(device: str) -> set[tuple[int, int, int]]:
    return {key for key, entry in _read_table(device).items() if entry.get("w8a8")}


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def clear_tables() -> None:
    """Forget the tables read so far (after CONFIG_DIR changes: the tuner, tests)."""
    for cached in (_read_table, tuned_table, w8a8_buckets):
        cached.cache_clear()


def m_bucket(num_rows: int) -> int:
    return next(bucket for bucket in M_BUCKETS if bucket >= num_rows)


def pick_tiles(num_rows: int, n: int, k: int, group_size: int | None, device: torch.device) -> GemvTiles:
    """The tuned tiles of (N, K, M bucket) on this GPU when they fit the scale groups, else the defaults."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tuned = tuned_table(_device_name(index)).get((n, k, m_bucket(num_rows)))
        if tuned is not None and _tiles_fit_groups(tuned, k, group_size):
            return tuned
    return default_tiles(num_rows, n, k, group_size)


def prefers_weight_only(num_rows: int, n: int, k: int, device: torch.device) -> bool:
    """W8A16 up to DEFAULT_MAX_ROWS rows unless the tuned table measured W8A8 faster for this (N, K, M bucket);
    beyond, up to MAX_ROWS, only where the table holds W8A16 tiles (measured faster than W8A8)."""
    if num_rows > MAX_ROWS:
        return False
    if device.type != "cuda":
        return num_rows <= DEFAULT_MAX_ROWS
    key = (n, k, m_bucket(num_rows))
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    if num_rows <= DEFAULT_MAX_ROWS:
        return key not in w8a8_buckets(name)
    return key in tuned_table(name)


def _tiles_fit_groups(tiles: GemvTiles, k: int, group_size: int | None) -> bool:
    """Every BLOCK_K step lies in one scale group: block_k divides the group and each split starts on one."""
    if group_size is None:
        return True
    chunk = triton.cdiv(k, tiles.split_k * tiles.block_k) * tiles.block_k
    return group_size % tiles.block_k == 0 and chunk % group_size == 0


def _check_tiles(tiles: GemvTiles, k: int, group_size: int | None) -> None:
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(tiles, name)
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size}")
    if tiles.use_dot and tiles.block_m < 16:
        raise ValueError(f"tensor-core tiles need block_m >= 16, got {tiles.block_m}")
    if tiles.swap_ab and not tiles.use_dot:
        raise ValueError("swap_ab is for tensor-core tiles (use_dot)")
    if tiles.act_fp8 and (not tiles.use_dot or tiles.block_k < 32):
        raise ValueError("act_fp8 is for tensor-core tiles (use_dot) of block_k >= 32 (the fp8 MMA's K)")
    if tiles.late_reduce and (tiles.use_dot or tiles.block_m != 1):
        raise ValueError("late_reduce is for FMA tiles of one row (block_m 1, no use_dot)")
    if not _tiles_fit_groups(tiles, k, group_size):
        raise ValueError(f"block_k {tiles.block_k} and split_k {tiles.split_k} must divide K={k} into whole "
                         f"scale groups of {group_size}")


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           group_size: int | None, bias: torch.Tensor | None = None,
                           tiles: GemvTiles | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (W * scale)^T for W e4m3 [N, K] with fp32 scales [N, 1] or [N, ceil(K / g)],
    x bf16/fp16/fp32 (at most MAX_ROWS rows), fp32 accumulation; reference.fp8_weight_only_linear. tiles: override."""
    y = fp8_weight_only_deferred(x, weight, weight_scale, group_size, bias, tiles, defer_split_k=False)
    assert isinstance(y, torch.Tensor)
    return y


def fp8_weight_only_deferred(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                             group_size: int | None, bias: torch.Tensor | None = None,
                             tiles: GemvTiles | None = None, defer_split_k: bool = True,
                             gated: bool = False) -> torch.Tensor | DeferredSum:
    """fp8_weight_only_linear, except that with defer_split_k, a 2-D x, no bias and split-K tiles the output is
    returned as its DeferredSum for the consumer to sum. gated: x is a gated MLP's [..., 2K] = [gate ‖ up] and
    the layer multiplies silu(gate) * up (activation.silu_and_mul's values) in the same launch."""
    k_in = (2 if gated else 1) * weight.shape[-1] if weight.dim() else -1
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE or weight.stride(1) != 1 or x.shape[-1] != k_in:
        what = "[gate ‖ up] of" if gated else "x of"
        raise ValueError(f"weight must be e4m3 [N, K] contiguous along K with {what} {k_in} columns, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    n, k = weight.shape
    groups = 1 if group_size is None else triton.cdiv(k, group_size)
    if weight_scale.shape != (n, groups) or weight_scale.dtype != torch.float32 or weight_scale.stride(1) != 1:
        raise ValueError(f"weight_scale must be fp32 [{n}, {groups}], got {tuple(weight_scale.shape)} "
                         f"{weight_scale.dtype}")
    x2 = gemv_rows(x, n, bias, MAX_ROWS if tiles is None else None, "the weight-only path")  # [M, K]
    num_rows = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if num_rows == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    tiles = tiles or pick_tiles(num_rows, n, k, group_size, x.device)
    out, part = launch_gemv(x2, weight, weight_scale, group_size, bias, tiles, gated)
    defer = defer_split_k and tiles.split_k > 1 and bias is None and x.dim() == 2
    if defer:
        return DeferredSum(part, x.dtype)
    if tiles.split_k > 1:
        _launch_split_k_sum(part, out, bias)
    return out.view(out_shape)


def gemv_rows(x: torch.Tensor, n: int, bias: torch.Tensor | None, max_rows: int | None, what: str) -> torch.Tensor:
    """x [..., K] as rows [M, K] contiguous along K, after checking bias ([N] contiguous) and M <= max_rows."""
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [N={n}] contiguous, got {tuple(bias.shape)}")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if max_rows is not None and x2.shape[0] > max_rows:
        raise ValueError(f"{what} serves at most {max_rows} rows, got {x2.shape[0]}")
    return x2


def launch_gemv(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, group_size: int | None,
                bias: torch.Tensor | None, tiles: GemvTiles, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of _w8a16_kernel for x2 [M, K] (M >= 1; gated: [M, 2K] = [gate ‖ up], multiplied as
    silu(gate) * up) and weight [N, K] (e4m3 with scales, or 16-bit with weight_scale None): (out [M, N], part
    [S, M, N] fp32 split-K partials; out itself when S == 1). With split-K, out is left unwritten: the caller sums
    part (+ bias) into it or defers the sum."""
    num_rows, (n, k) = x2.shape[0], weight.shape
    assert x2.shape[1] == (2 * k if gated else k) and x2.stride(1) == 1
    _check_tiles(tiles, k, group_size)
    if tiles.act_fp8 and weight_scale is None:
        raise ValueError("act_fp8 tiles multiply e4m3 weights (with their scales), not 16-bit ones")
    split = tiles.split_k
    out = torch.empty((num_rows, n), dtype=x2.dtype, device=x2.device)  # [M, N]
    part = torch.empty((split, num_rows, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(num_rows, tiles.block_m), split)
    even_k = k % (split * tiles.block_k) == 0
    fp32_dot = x2.dtype == torch.float32 or triton_interpreted()
    _w8a16_kernel[grid](x2, weight, weight_scale if weight_scale is not None else out, out, part,
                        bias if bias is not None else out, num_rows, n, k,
                        x2.stride(0), weight.stride(0), weight_scale.stride(0) if weight_scale is not None else 0,
                        out.stride(0), part.stride(0) if split > 1 else 0,
                        GROUP_K=group_size or 0, SPLIT_K=split, HAS_BIAS=bias is not None and split == 1,
                        USE_DOT=tiles.use_dot, EVEN_K=even_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                        BLOCK_K=tiles.block_k,
                        FP32_DOT=fp32_dot, DOT_PRECISION="ieee" if fp32_dot else "tf32",
                        LATE_REDUCE=tiles.late_reduce, HAS_SCALE=weight_scale is not None,
                        SWAP_AB=tiles.swap_ab, GATED=gated, ACT_FP8=tiles.act_fp8, HW_CAST=hw_cast(),
                        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                        **pdl.launch_options(x2.device))
    return out, part
