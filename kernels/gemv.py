"""Linear layers with 16-bit weights at a few rows (decode at small batch) on the weight-only FP8 kernel's code path
(kernels/fp8_weight_only.py, no scales): a Triton GEMV that launches under programmatic dependent launch like the
rest of a decode step's chain, where cuBLAS's GEMV breaks it (kernels/pdl.py). Semantics: torch.nn.functional.linear
with fp32 accumulation.

Measured slower than cuBLAS with untuned tiles (H200, 2026-12-03, bench/step_ab.py, graph-timed decode
step at 512 cached tokens, fp8_weight_only.default_tiles: llama3-8b bf16 4.53 -> 5.20 ms at B=1 and 4.76 -> 22.76
ms at B=4; deepseek-v2-lite 2.56 -> 2.58 ms at B=1, 4.38 -> 5.60 ms at B=4; the B=4 FMA tiles reduce every row in
one program). So the bf16/fp16 linear layers of decode steps (models/base.py `quantized_linear`) take it only
where a table tuned per GPU (`python -m pagoda.bench.gemv_tune`, gemv_configs/: per (N, K, M bucket) the best
tiles, or "cublas" where torch's linear was faster) holds tiles for them, at 1 to 256 rows (MAX_TUNED_ROWS: from
16 rows the tensor-core and swap_ab tiles with split-K, against cuBLAS's GEMMs at decode batches); elsewhere they
stay on torch's linear. PAGODA_DENSE_GEMV=1 also routes MLA's absorbed per-head projections to head_gemv
(models/deepseek.py, in place of torch.bmm) and lets single-token steps of dense models launch with PDL
(CausalLM.pdl_mode); PAGODA_DENSE_GEMV=0 turns the path off.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.fp8_weight_only import (
    M_BUCKETS,
    GemvTiles,
    _launch_split_k_sum,
    default_tiles,
    gemv_rows,
    launch_gemv,
    m_bucket,
    tiles_from_json,
)
from pagoda.shared.config import measurement_switch

MAX_ROWS = 8  # rows the untuned tiles (the interpreter's switch) and head_gemv serve
MAX_TUNED_ROWS = M_BUCKETS[-1]  # rows a GPU's tuned entry may serve (its tiles measured faster than cuBLAS there)
DTYPES = (torch.bfloat16, torch.float16)
CONFIG_DIR = Path(__file__).with_name("gemv_configs")
log = logging.getLogger(__name__)


def enabled() -> bool:
    """PAGODA_DENSE_GEMV=1: every switch of the 16-bit GEMV on (head_gemv for MLA's absorbed projections, PDL for
    dense single-token steps, the linears on the interpreter too). Unset, only the linears whose tuned entry on
    this GPU holds tiles take it (linear_takes_gemv); 0: none."""
    return measurement_switch("DENSE_GEMV") == "1"


def linear_takes_gemv(on_gpu: bool, entry: GemvTiles | str | None, rows: int = 1) -> bool:
    """The dispatch rule for a 16-bit linear of `rows` rows (at most MAX_TUNED_ROWS) that fits the GEMV (dtype,
    layout): on a GPU where its tuned entry holds tiles (they measured faster than cuBLAS there; untuned tiles were
    up to 5x slower: module docstring), unless PAGODA_DENSE_GEMV=0; off a GPU (the interpreter) only under
    PAGODA_DENSE_GEMV=1. Above MAX_ROWS rows only tuned tiles. Default on since the H200 step measured faster with
    the tuned linears (deepseek-v2-lite B=1, 512 cached tokens, graph: 2.313 -> 2.253 ms; bench/results/s27,
    2026-12-04)."""
    switch = measurement_switch("DENSE_GEMV")
    if switch == "0" or (rows > MAX_ROWS and not isinstance(entry, GemvTiles)):
        return False
    return isinstance(entry, GemvTiles) if on_gpu else switch == "1"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_gemv serves x [..., K] @ weight^T: a 2-D 16-bit weight of x's dtype, contiguous along K, and
    linear_takes_gemv (off a GPU the default tiles) for at most MAX_ROWS rows; up to MAX_TUNED_ROWS where this
    GPU's tuned entry for the rows' bucket holds tiles (tensor-core tiles at decode batches, tuned against cuBLAS)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (1 <= rows <= MAX_TUNED_ROWS and weight.dim() == 2 and weight.dtype in DTYPES and x.dtype == weight.dtype
            and weight.stride(1) == 1):
        return False
    on_gpu = weight.device.type == "cuda"
    n, k = weight.shape
    return linear_takes_gemv(on_gpu, _tuned_entry(rows, n, k, weight.device) if on_gpu else None, rows)


CUBLAS = "cublas"  # a tuned entry: torch's linear measured faster


def config_name(device: str) -> str:
    return f"dense,device={device},triton={triton.__version__}.json"


@functools.lru_cache(maxsize=4)
def tuned_table(device: str) -> dict[tuple[int, int, int], GemvTiles | str]:
    """{(N, K, M bucket): tiles, or CUBLAS} from gemv_configs/ for this device and Triton version (bench/gemv_tune.py
    writes it); {} when there is none."""
    path = CONFIG_DIR / config_name(device.replace(" ", "_"))
    if not path.exists():
        log.info("no tuned 16-bit GEMV tiles for %s (%s): its linears stay on torch's", device, path.name)
        return {}
    table: dict[tuple[int, int, int], GemvTiles | str] = {}
    for key, entry in json.loads(path.read_text()).items():
        n, k, bucket = (int(part) for part in key.split(","))
        table[(n, k, bucket)] = CUBLAS if entry.get(CUBLAS) else tiles_from_json(entry)
    return table


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _tuned_entry(num_rows: int, n: int, k: int, device: torch.device) -> GemvTiles | str | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuned_table(_device_name(index)).get((n, k, m_bucket(num_rows)))


def pick_tiles(num_rows: int, n: int, k: int, device: torch.device) -> GemvTiles:
    """The tuned tiles of (N, K, M bucket) on this GPU, else fp8_weight_only.default_tiles."""
    entry = _tuned_entry(num_rows, n, k, device)
    return entry if isinstance(entry, GemvTiles) else default_tiles(num_rows, n, k)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               tiles: GemvTiles | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias) for a bf16/fp16 W [N, K] contiguous along K and x of its dtype,
    fp32 accumulation, at most MAX_TUNED_ROWS rows unless tiles are given (the tuned tiles of the rows' bucket,
    else default_tiles). tiles: override."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.stride(1) != 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be bf16/fp16 [N, K={x.shape[-1]}] contiguous along K, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x must have the weight's dtype {weight.dtype}, got {x.dtype}")
    n, k = weight.shape
    x2 = gemv_rows(x, n, bias, MAX_TUNED_ROWS if tiles is None else None, "dense_gemv")  # [M, K]
    num_rows = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if num_rows == 0:
        return torch.empty(out_shape, dtype=x.dtype, device=x.device)
    tiles = tiles or pick_tiles(num_rows, n, k, x.device)
    out, part = launch_gemv(x2, weight, None, None, bias, tiles)
    if tiles.split_k > 1:
        _launch_split_k_sum(part, out, bias)
    return out.view(out_shape)


@triton.jit
def _head_gemv_kernel(x_ptr, w_ptr, out_ptr, T, K, N, stride_xh, stride_xt, stride_xk, stride_wh, stride_wk,
                      stride_wn, stride_oh, stride_ot, stride_on, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (head, n tile): out[h, t, n] = sum_k x[h, t, k] w[h, k, n] in fp32 for every row t < T, each weight
    tile read once for all rows; any strides (the weight may be contiguous along K or along N)."""
    pdl.launch_dependents(USE_PDL)
    head = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    pdl.wait(USE_PDL)
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptr + head * stride_wh + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BK, BN]
        for t in tl.static_range(BLOCK_T):
            x = tl.load(x_ptr + head * stride_xh + t * stride_xt + (k0 + offs_k) * stride_xk,
                        mask=k_mask & (t < T), other=0.0).to(tl.float32)  # [BK]
            row = tl.sum(w * x[:, None], 0)  # [BN]
            acc += tl.where(offs_t[:, None] == t, row[None, :], 0.0)
    tl.store(out_ptr + head * stride_oh + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_t < T)[:, None] & n_mask[None, :])


def head_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [heads, T, N] = x [heads, T, K] @ w [heads, K, N] per head (torch.bmm's values up to the order of fp32
    sums) for at most MAX_ROWS rows, any strides: MLA's absorbed projections at decode (W_UK into the query, W_UV
    out of the latent), as one Triton launch that stays in a decode step's PDL chain where cuBLAS's batched GEMM
    breaks it. out: written in place (any strides) and returned."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"x must be [heads, T, K] and w [heads, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or w.dtype not in DTYPES + (torch.float32,):
        raise ValueError(f"x and w must share a float dtype, got {x.dtype} and {w.dtype}")
    heads, rows, k = x.shape
    n = w.shape[2]
    if rows > MAX_ROWS:
        raise ValueError(f"head_gemv serves at most {MAX_ROWS} rows, got {rows}")
    if out is None:
        out = torch.empty((heads, rows, n), dtype=x.dtype, device=x.device)  # [heads, T, N]
    if out.shape != (heads, rows, n) or out.dtype != x.dtype:
        raise ValueError(f"out must be [{heads}, {rows}, {n}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if rows == 0:
        return out
    block_n = min(64, triton.next_power_of_2(n))
    while heads * triton.cdiv(n, block_n) < 128 and block_n > 16:
        block_n //= 2  # spread the few MB of weights over the SMs
    block_k = min(256 if block_n <= 16 else 128, triton.next_power_of_2(k))
    _head_gemv_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, out, rows, k, n, *x.stride(), *w.stride(), *out.stride(),
        BLOCK_T=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl.launch_options(x.device))
    return out
