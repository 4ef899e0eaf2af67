"""FP8 (e4m3) linear layers on the GPU: dynamic per-token (or per-token-group) activation quantization in Triton,
the per-channel GEMM through cuBLASLt (torch._scaled_mm, row-wise scales) and a Triton GEMM with per-group scales
for block-wise (128 x 128) checkpoints. Semantics: reference.quantize_fp8_rows and reference.fp8_linear.

cuBLASLt runs with fast accumulation (no periodic fp32 promotion of the tensor cores' FP8 sums; PAGODA_FP8_FAST_ACCUM=0
turns it off). H200, llama3-8b shapes, 2026-12-03: relative error to the fp32 product of the same e4m3 operands
2.1e-3 at K = 4096 and 3.3e-3 at K = 14336 (1.7e-3 with promotion; the e4m3 rounding of weights and activations
itself costs a few percent); GEMMs 3-12% faster at 256 and 8192 rows except down at 8192 (2% slower; third
session, bench/results/s3_mid/fp8_gemm.json). The quantization fused into the kernel before a GEMM (add + RMSNorm,
SiLU-and-mul) multiplies by 1 / scale and casts in hardware on the GPU: a code may differ from the exactly divided
one where the quotient lies within an fp32 ulp of a midpoint between e4m3 values (tests allow one step);
quantize_fp8_rows keeps torch's bits."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagoda.shared.config import measurement_switch, triton_interpreted

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-10  # as reference.FP8_MIN_AMAX
# The same numbers for use inside @triton.jit functions: compiled kernels only read constexpr globals
# (the interpreter reads any global, so only a GPU run catches a plain one).
FP8_MAX_C = tl.constexpr(FP8_MAX)
FP8_MIN_AMAX_C = tl.constexpr(FP8_MIN_AMAX)
_ROW_TILE = 8192  # most columns one per-token quantization program holds at once (rows longer loop twice)


@triton.jit
def round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: adding and removing
    M = ulp * 2^23 rounds at the ulp of x's binade (2^-9 below 2^-6, where e4m3 goes subnormal). The cast to
    e4m3 after it is exact; done this way because Triton 3.6's interpreter casts fp32 -> fp8 wrongly (no carry
    into the exponent, round half up), and on the GPU it costs a few ALU ops in a memory-bound kernel."""
    a = tl.abs(x)
    biased_exp = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased_exp = tl.maximum(biased_exp, 127 - 6)
    magic = ((biased_exp - 3 + 23) << 23).to(tl.float32, bitcast=True)  # ulp * 2^23
    r = (a + magic) - magic
    return tl.where(x < 0, -r, r)


@triton.jit
def cast_e4m3(y, HW_CAST: tl.constexpr):
    """fp32 y (|y| <= 448) -> e4m3, round to nearest even: the hardware cast on the GPU (HW_CAST), round_to_e4m3
    then an exact cast under the interpreter. The same codes either way."""
    if HW_CAST:
        return y.to(tl.float8e4nv)
    return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def quantize_by_inverse(h, scale, HW_CAST: tl.constexpr):
    """fp32 h -> e4m3 codes of h / scale, computed as h * (1 / scale) (one multiply an element, not a division):
    at most one fp32 ulp from the quotient, so a code differs from the exact one only where the quotient lies that
    close to the midpoint between two e4m3 values. HW_CAST (on the GPU): the hardware's round-to-nearest-even
    cast; else round_to_e4m3 first (Triton's interpreter casts fp32 -> e4m3 wrongly)."""
    return cast_e4m3(tl.clamp(h * tl.math.div_rn(1.0, scale), -FP8_MAX_C, FP8_MAX_C), HW_CAST)


def hw_cast() -> bool:
    """Whether kernels may cast fp32 -> e4m3 in hardware (not under Triton's interpreter)."""
    return not triton_interpreted()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, num_cols, stride_xm, stride_qm, stride_sm,
                          GROUP: tl.constexpr, TILE: tl.constexpr, PER_ROW: tl.constexpr, ONE_TILE: tl.constexpr,
                          HW_CAST: tl.constexpr):
    """PER_ROW: program (row, 0) quantizes a whole row with one scale (two passes over TILE-column tiles: amax,
    then scale and cast). Else program (row, g) quantizes columns [g * GROUP, (g + 1) * GROUP) (GROUP == TILE).
    Divisions round to nearest (div_rn, not the approximate default) so the bits are the reference's."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, TILE)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_TILE:  # the whole row in registers: read once
        cols = offs
        x = tl.load(x_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), FP8_MIN_AMAX_C), FP8_MAX_C)
        q = cast_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C), HW_CAST)
        tl.store(q_row + cols, q, mask=cols < num_cols)
        tl.store(s_ptr + row * stride_sm, scale)
    elif PER_ROW:
        amax = tl.zeros([TILE], tl.float32)
        for start in range(0, num_cols, TILE):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), FP8_MIN_AMAX_C), FP8_MAX_C)
        for start in range(0, num_cols, TILE):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
            q = cast_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C), HW_CAST)
            tl.store(q_row + cols, q, mask=cols < num_cols)
        tl.store(s_ptr + row * stride_sm, scale)
    else:
        cols = group * GROUP + offs
        mask = cols < num_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), FP8_MIN_AMAX_C), FP8_MAX_C)
        q = cast_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C), HW_CAST)
        tl.store(q_row + cols, q, mask=mask)
        tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_fp8_rows(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32/bf16/fp16, K contiguous) -> (e4m3 [M, K], fp32 scales [M, 1] or [M, ceil(K / g)]):
    dynamic per-row scales amax / 448, or per row and group of g columns (g a power of two >= 16)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] contiguous along K, got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    num_rows, num_cols = x.shape
    num_groups = 1 if group_size is None else triton.cdiv(num_cols, group_size)
    q = torch.empty((num_rows, num_cols), dtype=FP8_DTYPE, device=x.device)  # [M, K]
    scale = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)  # [M, G]
    if num_rows == 0:
        return q, scale
    if group_size is None:
        tile = min(_ROW_TILE, triton.next_power_of_2(num_cols))
        _quantize_rows_kernel[(num_rows, 1)](x, q, scale, num_cols, x.stride(0), q.stride(0), scale.stride(0),
                                             GROUP=tile, TILE=tile, PER_ROW=True, ONE_TILE=num_cols <= tile,
                                             HW_CAST=hw_cast(), num_warps=4 if tile <= 2048 else 8)
    else:
        _quantize_rows_kernel[(num_rows, num_groups)](x, q, scale, num_cols, x.stride(0), q.stride(0),
                                                      scale.stride(0), GROUP=group_size, TILE=group_size,
                                                      PER_ROW=False, ONE_TILE=False, HW_CAST=hw_cast(),
                                                      num_warps=1 if group_size <= 128 else 4)
    return q, scale


@triton.jit(do_not_specialize=["M"])  # the token count changes every step: no recompiles mid-serving
def _fp8_gemm_kernel(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, bias_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """C[M, N] = (A[M, K] * a_s) @ (B[N, K] * b_s)^T. PER_CHANNEL: a_s [M, 1], b_s [N, 1], applied once at the end.
    Else a_s [M, K / BLOCK_K], b_s [N, K / BLOCK_K]: each BLOCK_K step's fp32 partial product is scaled by its
    group's scales (BLOCK_K is the scale group, 128 for DeepSeek / Qwen FP8). Grid: tiles, grouped along M."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    b_rows = b_ptr + offs_n[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        cols = kb * BLOCK_K + offs_k
        k_mask = cols < K
        a = tl.load(a_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        b = tl.load(b_rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        if PER_CHANNEL:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            a_s = tl.load(a_s_ptr + offs_m * stride_asm + kb, mask=m_mask, other=0.0)  # [BM]
            b_s = tl.load(b_s_ptr + offs_n * stride_bsn + kb, mask=n_mask, other=0.0)  # [BN]
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    if PER_CHANNEL:
        a_s = tl.load(a_s_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _gemm_config(num_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of tokens: skinny decode GEMMs get narrow N tiles
    so enough programs stream the weights; large M gets 128 x 128 tiles."""
    if num_rows <= 16:
        return 16, 64, 4, 4
    if num_rows <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             group_size: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
             block: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton FP8 GEMM: a e4m3 [M, K] with scales [M, G], b e4m3 [N, K] with [N, G] (G = 1 per channel, or
    ceil(K / g) per group of g columns) -> [M, N] out_dtype. block: (BLOCK_M, BLOCK_N, warps, stages) override."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"a [M, K] and b [N, K] must share K, contiguous along K: {tuple(a.shape)}, {tuple(b.shape)}")
    (num_rows, k), n = a.shape, b.shape[0]
    groups = 1 if group_size is None else triton.cdiv(k, group_size)
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    if (a_scale.shape != (num_rows, groups) or b_scale.shape != (n, groups) or a_scale.dtype != torch.float32
            or b_scale.dtype != torch.float32 or a_scale.stride(1) != 1 or b_scale.stride(1) != 1):
        raise ValueError(f"scales must be fp32 [M, {groups}] and [N, {groups}], got {tuple(a_scale.shape)} "
                         f"{a_scale.dtype} and {tuple(b_scale.shape)} {b_scale.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [N={n}] contiguous, got {tuple(bias.shape)}")
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)  # [M, N]
    if num_rows == 0:
        return out
    block_m, block_n, warps, stages = block or _gemm_config(num_rows)
    block_k = group_size if group_size is not None else 128
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](a, a_scale, b, b_scale, out, bias if bias is not None else out, num_rows, n, k,
                           a.stride(0), b.stride(0), out.stride(0), a_scale.stride(0), b_scale.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                           PER_CHANNEL=group_size is None, HAS_BIAS=bias is not None,
                           num_warps=warps, num_stages=stages)
    return out


@functools.lru_cache(maxsize=8)
def scaled_mm_supported(device_index: int) -> bool:
    """torch._scaled_mm with row-wise scales needs cuBLASLt FP8 (compute capability >= 8.9: Ada, Hopper)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_rowwise(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """cuBLASLt: a e4m3 [M, K] with scales [M, 1], b e4m3 [N, K] with [N, 1] -> [M, N]. Row-wise scaling returns
    bf16 only, so other out dtypes are cast after. fast_accum: Hopper's FP8 accumulation without periodic fp32
    promotion (faster, less exact; measured in bench/fp8_bench.py, off in the model)."""
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.view(1, -1), out_dtype=torch.bfloat16,
                               use_fast_accum=fast_accum)
    except (RuntimeError, TypeError) as exc:
        raise RuntimeError(f"torch._scaled_mm (torch {torch.__version__}) rejected FP8 row-wise GEMM a "
                           f"{tuple(a.shape)}, b {tuple(b.shape)}: {exc}") from exc
    if isinstance(out, tuple):  # torch < 2.5 returned (out, amax)
        out = out[0]
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def fast_accum() -> bool:
    """cuBLASLt's FP8 GEMMs accumulate without the periodic fp32 promotion (PAGODA_FP8_FAST_ACCUM, default on)."""
    return measurement_switch("FP8_FAST_ACCUM") != "0"


def fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               group_size: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] out_dtype = quantized activations x_q [M, K] (scales [M, 1 or G]) @ W^T; reference.fp8_matmul.
    Per channel with bf16 out: cuBLASLt where it fits (Ada/Hopper, K and N multiples of 16); else Triton."""
    n, k = weight.shape
    if (group_size is None and out_dtype == torch.bfloat16 and x_q.is_cuda and k % 16 == 0 and n % 16 == 0
            and x_q.shape[0] > 0 and scaled_mm_supported(x_q.device.index or 0)):
        out = scaled_mm_rowwise(x_q, x_scale, weight, weight_scale, out_dtype, fast_accum())  # [M, N]
        return out if bias is None else out + bias
    return fp8_gemm(x_q, x_scale, weight, weight_scale, group_size, out_dtype, bias)  # [M, N]


@triton.jit
def _add_rms_norm_quant_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, residual_out_ptr, num_cols, eps,
                               stride_x, stride_r, stride_q, stride_ro, stride_xs, HAS_RESIDUAL: tl.constexpr,
                               X_PARTS: tl.constexpr, BLOCK_N: tl.constexpr, HW_CAST: tl.constexpr):
    """One row: summed = x + residual (rounded to the model dtype, stored), normed = weight * rms-normalised row
    (rounded as norm.py and the reference round), then per-token e4m3 quantization of normed. The model dtype is
    the norm weight's. x is X_PARTS terms stride_xs apart (X_PARTS > 1: a split-K GEMM's fp32 partials), summed in
    fp32 in order and rounded to the model dtype, as norm.py's parts path sums them."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < num_cols
    dtype = weight_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, X_PARTS):
        x += tl.load(x_ptr + part * stride_xs + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    x = x.to(dtype).to(tl.float32)  # the sum as the model dtype holds it (x itself for one term of that dtype)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / num_cols + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = (normed * weight).to(dtype).to(tl.float32)  # the model-dtype activation
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), 0), FP8_MIN_AMAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * stride_q + cols, quantize_by_inverse(h, scale, HW_CAST), mask=mask)
    tl.store(s_ptr + row, scale)


def add_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, D] -> (e4m3 [T, D], fp32 scales [T, 1], summed [T, D]) in one pass per row: the residual add
    and RMSNorm of norm.add_rms_norm, then per-token quantization; reference.add_rms_norm_quant_fp8. num_warps:
    override (measurements)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be [T, D] float, contiguous along D, got {tuple(x.shape)} {x.dtype}")
    return _norm_quant(x[None], x.dtype, residual, weight, eps, num_warps)


def add_rms_norm_parts_quant_fp8(parts: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm_quant_fp8(x, residual, ...) where x = the sum over S of parts [S, T, D] (fp32 or dtype, any
    strides along S and T) in fp32, in order, rounded to dtype (fp8_weight_only.DeferredSum), without x ever
    written: a weight-only layer that leaves its split-K sum to the next norm still gets the W8A8 GEMM after that
    norm its input quantized in the norm's pass (no quantize launch of its own).
    reference.add_rms_norm_parts_quant_fp8."""
    if (parts.dim() != 3 or parts.dtype not in (torch.float32, dtype) or parts.stride(2) != 1
            or parts.shape[0] < 1 or dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"parts must be fp32 or {dtype} [S, T, D] with D contiguous, got {tuple(parts.shape)} "
                         f"{parts.dtype} strides {parts.stride()}")
    return _norm_quant(parts, dtype, residual, weight, eps, None)


def _norm_quant(parts: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, num_warps: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checks and the one launch of both entry points: x = the sum of parts [S, T, D] rounded to dtype (S = 1:
    x itself, as a view)."""
    _, num_rows, num_cols = parts.shape
    if weight.shape != (num_cols,) or weight.dtype != dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be [{num_cols}] {dtype} contiguous, got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != parts.shape[1:] or residual.dtype != dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{num_rows}, {num_cols}] {dtype} contiguous along D, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if num_cols > 32768:
        raise ValueError(f"rows longer than 32768 do not fit one program, got {num_cols}")
    q = torch.empty((num_rows, num_cols), dtype=FP8_DTYPE, device=parts.device)  # [T, D]
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=parts.device)  # [T, 1]
    if residual is None:
        assert parts.shape[0] == 1 and parts.dtype == dtype, "partials come with a residual (the layer's input)"
        summed = parts[0]
    else:
        summed = torch.empty((num_rows, num_cols), dtype=dtype, device=parts.device)  # [T, D]
    if num_rows == 0:
        return q, scale, summed
    block_n = triton.next_power_of_2(num_cols)
    _add_rms_norm_quant_kernel[(num_rows,)](
        parts, residual if residual is not None else summed, weight, q, scale, summed, num_cols, eps,
        parts.stride(1), residual.stride(0) if residual is not None else 0, q.stride(0), summed.stride(0),
        parts.stride(0), HAS_RESIDUAL=residual is not None, X_PARTS=parts.shape[0], BLOCK_N=block_n,
        HW_CAST=hw_cast(), num_warps=num_warps or (4 if block_n <= 4096 else (8 if block_n <= 8192 else 16)))
    return q, scale, summed


@triton.jit
def _silu_and_mul_tile(x_row, cols, mask, inter_size):
    """silu(gate) * up of one TILE of columns in fp32, each product rounded to the model dtype as activation.py
    rounds it (x_row: the token's [gate | up] row)."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(x_row.dtype.element_ty).to(tl.float32)
    return (silu * up).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, inter_size, stride_x, stride_q, TILE: tl.constexpr,
                               ONE_PASS: tl.constexpr, HW_CAST: tl.constexpr):
    """One token: silu(gate) * up rounded to the model dtype as activation.py does, then per-token e4m3.
    ONE_PASS (TILE >= inter_size): the row's products stay in registers, gate and up are read once. Else in
    TILE-column tiles twice (amax, then quantize, recomputing the product)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, TILE)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        mask = offs < inter_size
        h = _silu_and_mul_tile(x_row, offs, mask, inter_size)  # [TILE]
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), 0), FP8_MIN_AMAX_C), FP8_MAX_C)
        tl.store(q_row + offs, quantize_by_inverse(h, scale, HW_CAST), mask=mask)
    else:
        amax = tl.zeros([TILE], tl.float32)
        for start in range(0, inter_size, TILE):
            cols = start + offs
            amax = tl.maximum(amax, tl.abs(_silu_and_mul_tile(x_row, cols, cols < inter_size, inter_size)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), FP8_MIN_AMAX_C), FP8_MAX_C)
        for start in range(0, inter_size, TILE):
            cols = start + offs
            mask = cols < inter_size
            h = _silu_and_mul_tile(x_row, cols, mask, inter_size)
            tl.store(q_row + cols, quantize_by_inverse(h, scale, HW_CAST), mask=mask)
    tl.store(s_ptr + row, scale)


ONE_PASS_MAX_COLS = 16384  # rows up to this many products are quantized from registers (16 warps: 32 a thread)


def silu_and_mul_quant_fp8(gate_up: torch.Tensor, tile: int | None = None,
                           num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] -> (e4m3 silu(gate) * up [T, I], fp32 scales [T, 1]); reference.silu_and_mul_quant_fp8.
    tile: columns a pass (default: the whole row in one pass up to ONE_PASS_MAX_COLS, else 2048-column tiles
    twice); num_warps: override (measurements)."""
    if (gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1
            or gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"gate_up must be [T, 2I] float, contiguous along its last dim, got {tuple(gate_up.shape)}")
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    num_rows, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty((num_rows, inter_size), dtype=FP8_DTYPE, device=gate_up.device)  # [T, I]
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=gate_up.device)  # [T, 1]
    if num_rows == 0:
        return q, scale
    whole_row = triton.next_power_of_2(inter_size)
    if tile is None:
        tile = whole_row if whole_row <= ONE_PASS_MAX_COLS else 2048
    tile = min(tile, whole_row)
    if num_warps is None:
        num_warps = 4 if tile <= 1024 else (8 if tile <= 4096 else 16)
    _silu_and_mul_quant_kernel[(num_rows,)](gate_up, q, scale, inter_size, gate_up.stride(0), q.stride(0),
                                            TILE=tile, ONE_PASS=tile >= inter_size, HW_CAST=hw_cast(),
                                            num_warps=num_warps)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (W e4m3 [N, K], fp32 scales [N, 1] or [N, ceil(K / g)]), activations quantized
    per token (and group) on the fly; semantics of reference.fp8_linear. Per channel: cuBLASLt where it fits
    (Ada/Hopper, bf16 activations, K and N multiples of 16), else the Triton GEMM; per group: the Triton GEMM."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be e4m3 [N, K={x.shape[-1]}], got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    x_q, x_scale = quantize_fp8_rows(x2, group_size)  # [M, K] e4m3, [M, G] fp32
    # cuBLASLt's row-wise FP8 GEMM writes bf16 only: fp32/fp16 models take the Triton GEMM (exact output dtype)
    out = fp8_matmul(x_q, x_scale, weight, weight_scale, group_size, x.dtype, bias)  # [M, N]
    return out.view(*x.shape[:-1], n)
