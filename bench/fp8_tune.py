"""FP8 linear layers on one GPU: tune the weight-only (W8A16) kernel's tiles per shape and M bucket, pick W8A16 or
W8A8 per bucket, then sweep every M against bf16 with the dispatch the model uses.

    python -m pagoda.bench.fp8_tune [--shapes llama3-8b] [--out $OUT]

1. Tuning (M = 1 .. 256): every candidate tile set (FMA rows for M <= 4, tensor-core tiles beyond; narrow N
   tiles, split-K) is checked against the reference, then timed as decode runs it: replayed from a CUDA graph
   that cycles through enough copies of the weights (>= 256 MB) that none is in L2 when its turn comes. The best
   (tensor-core tiles with and without swap_ab, and act_fp8 tiles, which quantize the activation tile they load:
   W8A8 with no quantize kernel; the committed entry too) is kept, unless cuBLASLt's W8A8 GEMM
   (plus the activation quantization where no fused op does it: o_proj) is faster; above 32 rows W8A16 must win
   to be kept. o and down, both paths, are timed with the residual norm the model runs after them, which sums a
   split-K tile's partials (no sum kernel). --swap-only / --act-fp8-only: only those tiles against the committed
   entry. The candidates are compiled first in --compile-jobs processes (Triton's on-disk cache then serves the
   timing loop); --layers tunes some of a shape's layers only (e.g. `--layers o --buckets 64,128`).
2. Sweep (M = 1 .. 8192): bf16 F.linear, W8A16 (M <= 32), W8A8 with the quantization fused into the previous op
   (qkv, gate_up, down) or a kernel of its own (o), and the dispatch's choice; bandwidth on the weight bytes. At
   M = 1 also W8A16 launched as a single-token step launches it (programmatic dependent launch, pdl.FIRST: each
   GEMV may start while the one before it drains; `w8a16_chained`). For o and down also the pair the model runs:
   the layer and the residual add + RMSNorm after it, which sums a weight-only layer's split-K partials (no sum
   kernel), against bf16's GEMM + norm (`*_with_norm`).
   The per-layer error of every path against the fp32 reference is printed with it.

Writes fp8_tune.json (sweep rows) and w8a16_table.json (commit it as
kernels/fp8_configs/w8a16,device=<GPU name>,triton=<version>.json) under --out or $OUT.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.report import write_json

SHAPES = {  # (name, N, K) of each linear layer
    "llama3-8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)),
    "qwen3-8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)),
}
SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192)
W8A8_MARGIN = 0.97  # W8A8 must beat the best W8A16 by 3% to take a bucket


def candidates(bucket: int) -> list[Any]:
    from pagoda.kernels.fp8_weight_only import GemvTiles

    out = []
    if bucket <= 4:  # FMA rows: every row in one program (one row: reducing over K every step or at the end)
        for block_n, block_k, split, late in itertools.product((8, 16, 32), (512, 1024), (1, 2, 4),
                                                               (False, True) if bucket == 1 else (False,)):
            warps = ((4, 4), (8, 3)) if block_k == 1024 else ((4, 4),)
            out += [GemvTiles(block_m=bucket, block_n=block_n, block_k=block_k, split_k=split, use_dot=False,
                              num_warps=w, num_stages=st, late_reduce=late) for w, st in warps]
    if bucket > 32:  # larger tiles: the weights are read once per BLOCK_M rows
        # split-K and 32-wide N tiles too: a 4096-wide layer makes only 64 programs of 64 columns (o_proj at 64
        # rows reached 0.7 TB/s without them, 2026-12-02)
        for block_m, block_n, block_k, split, (warps, stages) in itertools.product(
                (64, 128), (32, 64, 128), (64, 128), (1, 2, 4), ((4, 3), (8, 3))):
            out.append(GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, use_dot=True,
                                 num_warps=warps, num_stages=stages))
        return out + swap_candidates(bucket) + act_fp8_candidates(bucket)
    if bucket >= 2:  # tensor-core tiles, rows padded to 16 or 32
        for block_m, block_n, block_k, split in itertools.product((16, 32), (16, 32, 64), (128, 256), (1, 2, 4)):
            if block_m < bucket:
                continue  # two M tiles would read the weights twice
            out.append(GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, use_dot=True,
                                 num_warps=4, num_stages=4))
        out += swap_candidates(bucket)
    return out + act_fp8_candidates(bucket)


def act_fp8_candidates(bucket: int) -> list[Any]:
    """Tensor-core tiles that quantize the activation tile they load (W8A8 on fp8 tensor cores, no quantize kernel:
    GemvTiles.act_fp8), at every bucket: swap_ab tiles (the e4m3 weight tile straight into QGMMA: at 1-16 rows 46-60
    sm_90 loop instructions a KB of weights against 110-216 for the FMA and 126-143 for the W8A16 tensor-core tiles,
    bench/results/s18/gemv_sass.md), and from 32 rows plain ones too (below that the plain tiles run mma.sync on
    fp16 and convert the weights anyway)."""
    from pagoda.kernels.fp8_weight_only import GemvTiles

    rows = (max(16, bucket),) if bucket <= 32 else (64, 128)
    launch = ((64, 4), (128, 4), (128, 8), (256, 8))  # (weight rows a program, warps)
    out = [GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, use_dot=True,
                     num_warps=warps, num_stages=3, swap_ab=True, act_fp8=True)
           for block_m, (block_n, warps), block_k, split in itertools.product(rows, launch, (128, 256), (1, 2, 4))
           if block_n * block_k <= 32768]
    if bucket >= 32:
        for block_m, block_n, split, warps in itertools.product(rows, (64, 128), (1, 2, 4), (4, 8)):
            out.append(GemvTiles(block_m=block_m, block_n=block_n, block_k=128, split_k=split, use_dot=True,
                                 num_warps=warps, num_stages=3, act_fp8=True))
    return out


def swap_candidates(bucket: int) -> list[Any]:
    """Tensor-core tiles with the weight tile on the dot's M side (swap_ab), from 8 rows: 64-256 weight rows a
    program, the token rows (16 and up) on N."""
    from pagoda.kernels.fp8_weight_only import GemvTiles

    if bucket < 8:
        return []
    rows = (max(16, bucket),) if bucket <= 32 else (64, 128)
    launch = ((64, 4), (128, 4), (128, 8), (256, 8))  # (weight rows a program, warps)
    out = []
    for block_m, (block_n, warps), block_k, split in itertools.product(rows, launch, (128, 256), (1, 2, 4)):
        if block_n * block_k > 32768:
            continue  # register-starved
        out.append(GemvTiles(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, use_dot=True,
                             num_warps=warps, num_stages=3, swap_ab=True))
    return out


POOLS: dict[str, Callable[[int], list[Any]]] = {"all": candidates, "swap": swap_candidates,
                                                 "act_fp8": act_fp8_candidates}


def _cosine(out: torch.Tensor, expected: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(out.float(), expected.float(), dim=1).min().item()


ROTATE_BYTES = 256 << 20  # the weight copies a timing graph cycles through: > 4x the H200's 50 MB L2


def _weights(n: int, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(bf16 copies, e4m3 copies, scale copies): enough of each that cycling through them defeats the L2."""
    from pagoda.kernels import reference as ref

    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()  # [N, K]
    w_q, w_s = ref.quantize_fp8_rows(w)
    bf16_copies = max(2, min(16, -(-ROTATE_BYTES // (2 * n * k))))
    fp8_copies = max(2, min(16, -(-ROTATE_BYTES // (n * k))))
    return ([w] + [w.clone() for _ in range(bf16_copies - 1)], [w_q] + [w_q.clone() for _ in range(fp8_copies - 1)],
            [w_s] + [w_s.clone() for _ in range(fp8_copies - 1)])


def rotating_us(op: Callable[..., object], x: Any, weights: list[torch.Tensor], scales: list[torch.Tensor] | None,
                *args: Any, **kwargs: Any) -> float:
    """Device time of op(x, weight_i[, scale_i], *args) per call, replayed from a CUDA graph over every copy."""
    if scales is None:
        calls = [partial(op, x, w, *args, **kwargs) for w in weights]
    else:
        calls = [partial(op, x, w, s, *args, **kwargs) for w, s in zip(weights, scales, strict=True)]
    return 1e3 * graph_time_ms(calls, reps=10)


def _in_pdl_chain(op: Callable[..., object]) -> Callable[..., object]:
    """op launched as CausalLM.pdl_mode launches a single-token step's kernels (pdl.FIRST: where supported)."""
    from pagoda.kernels import pdl

    def chained(*args: Any, **kwargs: Any) -> object:
        with pdl.scope(pdl.FIRST):
            return op(*args, **kwargs)
    return chained


def compile_tiles(n: int, k: int, bucket: int, tiles: list[dict[str, Any]]) -> int:
    """Launch the W8A16 kernel once with each tile set at (M=bucket, N=n, K=k), as tune_shape launches it (same
    dtypes, contiguous operands: the same specialisations), so Triton's on-disk cache holds the compiled kernels;
    a tile set the device refuses is skipped. Returns how many launched. On CUDA if there is one."""
    from pagoda.kernels import fp8_weight_only as w8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(bucket, k, dtype=torch.bfloat16, device=device)  # [M, K]
    weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)  # [N, K]
    scale = torch.ones(n, 1, dtype=torch.float32, device=device)  # [N, 1]
    launched = 0
    for entry in tiles:
        try:
            w8.fp8_weight_only_linear(x, weight, scale, None, tiles=w8.tiles_from_json(entry))
            launched += 1
        except Exception:  # noqa: BLE001 - out of shared memory or registers: tune_shape reports it
            continue
    return launched


def precompile(n: int, k: int, buckets: tuple[int, ...], pool: str, jobs: int,
               executor: Executor | None = None,
               compile_fn: Callable[[int, int, int, list[dict[str, Any]]], int] | None = None,
               candidates_of: Callable[[int], list[Any]] | None = None) -> int:
    """Compile every candidate of the buckets in `jobs` parts before tune_shape times them (serially the compiles
    dominate a retune: one pool of one bucket is ~180 tile sets). By default in `jobs` spawned processes, each its
    own CUDA context; returns how many launched. compile_fn (a module-level function: it is pickled to the
    processes) and candidates_of default to this tuner's compile_tiles and POOLS[pool]; bench/gemv_tune passes
    its 16-bit ones."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from pagoda.kernels import fp8_weight_only as w8

    compile_fn = compile_fn or compile_tiles
    candidates_of = candidates_of or POOLS[pool]
    work = [(bucket, [w8.tiles_to_json(t) for t in candidates_of(bucket)[part::jobs]])
            for bucket in buckets for part in range(jobs)]
    with executor or ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as running:
        futures = [running.submit(compile_fn, n, k, bucket, tiles) for bucket, tiles in work if tiles]
        return sum(future.result() for future in futures)


def tune_shape(name: str, n: int, k: int, w_q: list[torch.Tensor], w_s: list[torch.Tensor],
               buckets: tuple[int, ...], pool: str = "all", device: str = "cuda") -> dict[int, dict[str, Any]]:
    """{bucket: {"tiles", "us", "w8a8_us", "choice"}} for one shape. The committed table's tiles for the bucket
    (if any) are always among the candidates; pool "swap" / "act_fp8": only they and those tiles. o and down are
    timed with the residual norm the model runs after them (ThenNorm), both paths: a split-K tile's sum is that
    norm's, not a kernel's."""
    from pagoda.kernels import fp8_weight_only as w8
    from pagoda.kernels import reference as ref

    result = {}
    table = w8.tuned_table(torch.cuda.get_device_name()) if device == "cuda" else {}
    for bucket in buckets:
        x = torch.randn(bucket, k, device=device).bfloat16()  # [M, K]
        then = ThenNorm(name, bucket, n, x.device)
        weight_only = ref.fp8_weight_only_linear(x, w_q[0], w_s[0], None)
        best: tuple[float, Any] | None = None
        committed = table.get((n, k, bucket))
        tried = POOLS[pool](bucket)
        for tiles in ([committed] if committed and committed not in tried else []) + tried:
            try:
                out = w8.fp8_weight_only_linear(x, w_q[0], w_s[0], None, tiles=tiles)
            except Exception as exc:  # a tile set this GPU cannot compile (shared memory, registers): skip it
                print(f"  {name} M={bucket} {tiles}: {type(exc).__name__}")
                continue
            expected = (ref.fp8_act_tile_linear(x, w_q[0], w_s[0], None, tiles.block_k) if tiles.act_fp8
                        else weight_only)
            if _cosine(out, expected) < 0.999:
                raise AssertionError(f"{name} M={bucket} {tiles}: cosine {_cosine(out, expected):.5f}")
            us = rotating_us(w8a16_op(tiles, then), x, w_q, w_s)
            if best is None or us < best[0]:
                best = (us, tiles)
        assert best is not None
        w8a8_us = rotating_us(w8a8_op(name, x, then), x, w_q, w_s)
        if bucket <= w8.DEFAULT_MAX_ROWS:
            choice = "w8a8" if w8a8_us < W8A8_MARGIN * best[0] else "w8a16"
        else:
            choice = "w8a16" if best[0] < W8A8_MARGIN * w8a8_us else "w8a8"
        result[bucket] = {"tiles": w8.tiles_to_json(best[1]), "us": best[0], "w8a8_us": w8a8_us, "choice": choice}
        print(f"tune {name:8s} N={n:6d} K={k:6d} M={bucket:3d}: w8a16 {best[0]:7.1f} us "
              f"({n * k / best[0] / 1e6:5.2f} TB/s) {best[1]}; w8a8 {w8a8_us:7.1f} us -> {choice}"
              + (" (each with the norm after it)" if then.on else ""), flush=True)
    return result


NORMED_AFTER = ("o", "down")  # layers whose output the next residual add + RMSNorm takes (as partials if split)


class ThenNorm:
    """What the model runs on a layer's output on one device (models/llama.py) when timing it: for o and down the
    residual add + RMSNorm after them, which sums a weight-only layer's split-K partials itself (DeferredSum: no
    sum kernel); for the other layers nothing (their output is used as it is)."""

    def __init__(self, name: str, m: int, n: int, device: torch.device) -> None:
        self.on = name in NORMED_AFTER
        rows = m if self.on else 0
        self.residual = torch.randn(rows, n, device=device).bfloat16()  # [M, N] (none when off)
        self.weight = torch.ones(n, device=device, dtype=torch.bfloat16)  # [N]

    def __call__(self, y: Any) -> object:
        from pagoda.kernels import fp8_weight_only as w8
        from pagoda.kernels import norm

        if not self.on:
            return y
        if isinstance(y, w8.DeferredSum):
            return norm.add_rms_norm_parts(y.parts, y.dtype, self.residual, self.weight, 1e-5)
        return norm.add_rms_norm(y, self.residual, self.weight, 1e-5)


def w8a16_op(tiles: Any, then: ThenNorm) -> Callable[..., object]:
    """(x, e4m3 weight, scales) -> the weight-only GEMV with these tiles (None: the dispatch's) and what follows
    it: alone with its own split-K sum, or before the norm that takes its partials."""
    from pagoda.kernels import fp8_weight_only as w8

    if then.on:
        return lambda x_, w, s: then(w8.fp8_weight_only_deferred(x_, w, s, None, tiles=tiles))
    return lambda x_, w, s: w8.fp8_weight_only_linear(x_, w, s, None, tiles=tiles)


def w8a8_op(name: str, x: torch.Tensor, then: ThenNorm) -> Callable[..., object]:
    """(x, e4m3 weight, scales) -> W8A8 as the model runs it, then what follows: the GEMM alone where the previous
    op quantizes (qkv, gate_up, down: x quantized once, outside the timing), with its own quantize kernel for o
    (the attention output)."""
    from pagoda.kernels import fp8

    if name == "o":
        return lambda x_, w, s: then(fp8.fp8_linear(x_, w, s, None))
    x_q, x_s = fp8.quantize_fp8_rows(x)
    return lambda x_, w, s: then(fp8.fp8_matmul(x_q, x_s, w, s, None, torch.bfloat16))


def with_norm_us(name: str, x: torch.Tensor, w: list[torch.Tensor], w_q: list[torch.Tensor],
                 w_s: list[torch.Tensor]) -> tuple[float, float]:
    """(bf16, FP8 dispatch) device time of o or down together with the residual add + RMSNorm after it, as the
    model runs the pair on one device (ThenNorm): a weight-only layer's split-K partials left to that norm (no sum
    kernel; the norm reads the partials), a W8A8 o with its own quantize kernel, a W8A8 down on activations
    quantized by the op before it. Quantization for the GEMM after the norm is that GEMM's, as in the sweep."""
    import torch.nn.functional as F

    from pagoda.kernels import fp8_weight_only as w8

    m, (n, k) = x.shape[0], w[0].shape
    then = ThenNorm(name, m, n, x.device)
    assert then.on, "o and down only"
    fp8_pair = w8a16_op(None, then) if w8.prefers_weight_only(m, n, k, x.device) else w8a8_op(name, x, then)
    return rotating_us(lambda x_, weight: then(F.linear(x_, weight)), x, w, None), rotating_us(fp8_pair, x, w_q, w_s)


def sweep_row(name: str, n: int, k: int, m: int, w: list[torch.Tensor], w_q: list[torch.Tensor],
              w_s: list[torch.Tensor]) -> dict[str, Any]:
    """One (shape, M): bf16, W8A16 (where the kernel serves M), W8A8 fused / with its own quantization, and the
    dispatch's choice, each timed over rotating weight copies from a CUDA graph."""
    import torch.nn.functional as F

    from pagoda.kernels import fp8
    from pagoda.kernels import fp8_weight_only as w8

    x = torch.randn(m, k, device="cuda").bfloat16()  # [M, K]
    x_q, x_s = fp8.quantize_fp8_rows(x)
    row: dict[str, Any] = {"gemm": name, "M": m, "N": n, "K": k}
    row["bf16_us"] = rotating_us(F.linear, x, w, None)
    row["w8a8_fused_quant_us"] = rotating_us(lambda x_, wq, s: fp8.fp8_matmul(x_q, x_s, wq, s, None, torch.bfloat16),
                                             x, w_q, w_s)
    row["w8a8_own_quant_us"] = rotating_us(lambda x_, wq, s: fp8.fp8_linear(x_, wq, s, None), x, w_q, w_s)
    exact = x.float() @ w[0].float().t()  # [M, N]
    row["cosine_w8a8"] = _cosine(fp8.fp8_linear(x, w_q[0], w_s[0], None), exact)
    weight_only = w8.prefers_weight_only(m, n, k, x.device)
    tile_quant = weight_only and w8.pick_tiles(m, n, k, None, x.device).act_fp8  # W8A8 inside the GEMV kernel
    if m <= w8.DEFAULT_MAX_ROWS or weight_only:
        row["w8a16_us"] = rotating_us(lambda x_, wq, s: w8.fp8_weight_only_linear(x_, wq, s, None), x, w_q, w_s)
        row["cosine_w8a16"] = _cosine(w8.fp8_weight_only_linear(x, w_q[0], w_s[0], None), exact)
        row["w8a16_act_fp8"] = w8.pick_tiles(m, n, k, None, x.device).act_fp8
    if m == 1:  # as a single-token step runs it: each launch under PDL, overlapping the previous one's tail
        row["w8a16_chained_us"] = rotating_us(_in_pdl_chain(w8.fp8_weight_only_linear), x, w_q, w_s, None)
    row["dispatch"] = "w8a16" if weight_only else ("w8a8_own_quant" if name == "o" else "w8a8_fused_quant")
    row["dispatch_us"] = row[f"{row['dispatch']}_us"]
    if tile_quant:
        row["dispatch"] = "w8a8_tile_quant"  # timed as w8a16_us: the same kernel with act_fp8 tiles
    row["speedup_vs_bf16"] = row["bf16_us"] / row["dispatch_us"]
    if name in NORMED_AFTER:  # as the model runs it: the split-K sum (if any) left to the norm after the layer
        row["bf16_with_norm_us"], row["dispatch_with_norm_us"] = with_norm_us(name, x, w, w_q, w_s)
        row["speedup_with_norm"] = row["bf16_with_norm_us"] / row["dispatch_with_norm_us"]
    row["fp8_TBps"] = (n * k + m * k * 2) / row["dispatch_us"] / 1e6
    if "w8a16_chained_us" in row:
        row["fp8_chained_TBps"] = (n * k + m * k * 2) / row["w8a16_chained_us"] / 1e6
    row["bf16_TBps"] = (2 * n * k + m * k * 2) / row["bf16_us"] / 1e6
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--layers", default="", help="tune and sweep only these layers (comma-separated, of qkv, o, "
                                                     "gate_up, down; default all)")
    parser.add_argument("--skip-tune", action="store_true", help="sweep with the committed table")
    parser.add_argument("--buckets", default="", help="tune only these M buckets (comma-separated), keeping the "
                                                      "committed table's other entries")
    parser.add_argument("--skip-sweep", action="store_true", help="tune only")
    parser.add_argument("--swap-only", action="store_true",
                        help="tune only the swap_ab tiles against the committed entry of each bucket")
    parser.add_argument("--act-fp8-only", action="store_true",
                        help="tune only the act_fp8 tiles (from 32 rows) against the committed entry of each bucket")
    parser.add_argument("--compile-jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that compile the candidates before they are timed (1: compile as timed)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/fp8_tune"))
    args = parser.parse_args()
    from pagoda.kernels import fp8_weight_only as w8

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else w8.M_BUCKETS
    if not set(buckets) <= set(w8.M_BUCKETS):
        parser.error(f"--buckets must be among {w8.M_BUCKETS}")
    table: dict[str, Any] = {}
    if args.buckets:  # start from the committed entries
        table = {",".join(map(str, key)): entry for key, entry in w8._read_table(device).items()}
    layers = set(args.layers.split(",")) if args.layers else None
    if layers and not layers <= {name for shape in SHAPES.values() for name, _, _ in shape}:
        parser.error("--layers must be among qkv, o, gate_up, down")
    selected = [(shape, name, n, k) for shape in args.shapes.split(",") for name, n, k in SHAPES[shape]
                if not layers or name in layers]
    rows: list[dict[str, Any]] = []
    started = time.time()
    for _, name, n, k in selected:
        w, w_q, w_s = _weights(n, k)
        if not args.skip_tune:
            pool = "swap" if args.swap_only else "act_fp8" if args.act_fp8_only else "all"
            if args.compile_jobs > 1:
                compiled_at = time.time()
                launched = precompile(n, k, buckets, pool, args.compile_jobs)
                print(f"precompiled {name}: {launched} tile sets in {time.time() - compiled_at:.0f} s "
                      f"({args.compile_jobs} processes)", flush=True)
            for bucket, entry in tune_shape(name, n, k, w_q, w_s, buckets, pool).items():
                table[f"{n},{k},{bucket}"] = {"w8a8": True} if entry["choice"] == "w8a8" else entry["tiles"]
        del w, w_q, w_s
        torch.cuda.empty_cache()
    if table:
        (out_dir / "w8a16_table.json").write_text(json.dumps(table, indent=1, sort_keys=True))
        w8.CONFIG_DIR = out_dir  # the sweep below dispatches with the table just tuned
        (out_dir / w8.config_name(device.replace(" ", "_"))).write_text(json.dumps(table))
        w8.clear_tables()
    print(f"tuned in {time.time() - started:.0f} s", flush=True)
    if args.skip_sweep:
        return 0
    for shape, name, n, k in selected:
        w, w_q, w_s = _weights(n, k)
        for m in SWEEP_M:
            row = sweep_row(name, n, k, m, w, w_q, w_s)
            rows.append({"shape": shape, **row})
            paths = " ".join(f"{key[:-3]} {row[key]:.1f}" for key in row if key.endswith("_us"))
            print(f"sweep {shape} {name:8s} M={m:5d}: {paths} | {row['dispatch']} "
                  f"{row['speedup_vs_bf16']:.2f}x bf16, {row['fp8_TBps']:.2f} TB/s; cos w8a8 "
                  f"{row['cosine_w8a8']:.5f} w8a16 {row.get('cosine_w8a16', float('nan')):.5f}", flush=True)
        del w, w_q, w_s
        torch.cuda.empty_cache()
    slower = [row for row in rows if row["speedup_vs_bf16"] < 1.0]
    print(f"FP8 slower than bf16 in {len(slower)} of {len(rows)} (shape, M): "
          + ", ".join(f"{row['gemm']} M={row['M']} {row['speedup_vs_bf16']:.2f}x" for row in slower))
    paired = [row for row in rows if "speedup_with_norm" in row]
    slower_paired = [row for row in paired if row["speedup_with_norm"] < 1.0]
    print(f"FP8 slower than bf16 with the norm after o / down in {len(slower_paired)} of {len(paired)}: "
          + ", ".join(f"{row['gemm']} M={row['M']} {row['speedup_with_norm']:.2f}x" for row in slower_paired))
    write_json(out_dir / "fp8_tune.json", {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                           "device": device, "torch": torch.__version__, "table": table, "sweep": rows},
               indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
