"""Tune the fused MoE kernel's tiles per token-count bucket on this GPU, check it against the reference, and report
what the tuned kernel reaches: HBM bandwidth on the expert bytes it reads (small batches) and bf16 matmul rate
(large ones).

    python -m pagoda.bench.moe_tune --shapes qwen3-30b-a3b,mixtral-8x7b [--write] [--out results.json]
    python -m pagoda.bench.moe_tune --weights fp8 --shapes deepseek-v2-lite --buckets 256,1024,8192 --write

--write stores the table under kernels/moe_configs/ (named by experts, sizes, dtype, device and Triton version),
where kernels/moe.py looks it up at run time; a committed table's other buckets are kept (--buckets 1,2 retunes
those two only).

--weights fp8 tunes FP8 experts (e4m3, per-row scales as --quantization fp8 stores them; --group-k 128 for block
scales) with bf16 activations: every grouped-GEMM tile both weight-only and W8A8 (act_fp8: the activation tile
quantized where it is loaded), each GEMM's fastest form kept, into the dtype=float8_e4m3fn table. FP8 experts use
that table from its smallest bucket up (the bf16 table's tiles below it), so tune from where the form starts to
matter (weight-only FP8 experts were slower than bf16 from ~1024 tokens on an H100, 2026-12-05).

Decode runs a layer's experts once a step, with 26-60 other layers in between: its weights are never in L2. So where
one launch reads less than 4x the L2 cache, each candidate is timed over several copies of the weights and as many
routings, one launch per (copy, routing) in one graph. One routing over one copy (until the twenty-seventh session)
kept a small batch's experts in L2 and picked tiles that are slow from HBM: at one token, deepseek-v2-lite's down
GEMV took 21.4 us with the tile so chosen and 12.9 us with the best tile timed cold (H200, 2026-12-04).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.report import write_json
from pagoda.kernels import moe
from pagoda.kernels import reference as ref
from pagoda.services.worker.models.deepseek import fused_shared_experts
from pagoda.services.worker.models.moe import fused_gated_shared_experts
from pagoda.shared.shapes import SHAPES

HBM_BYTES_PER_S = 4.2e12
MATMUL_FLOPS = 780e12
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CANDIDATES = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
    (16, 64, 64, 1, 4, 5), (32, 64, 128, 4, 4, 4), (32, 128, 64, 4, 4, 4), (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 8, 4), (64, 128, 64, 1, 4, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 1, 8, 4),
    (64, 256, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4), (64, 128, 128, 8, 8, 2), (128, 128, 32, 8, 8, 5),
    (32, 64, 256, 1, 4, 3), (16, 128, 256, 1, 4, 3),
    # memory-bound middle batches (a few dozen rows an expert, e.g. DeepSeek-V2-Lite decode at 256 tokens): wider
    # K steps and deeper pipelines
    (32, 128, 128, 1, 4, 4), (32, 128, 64, 1, 4, 6), (32, 256, 64, 1, 8, 4), (64, 128, 128, 1, 8, 3),
    (64, 64, 128, 1, 4, 4), (32, 64, 128, 1, 4, 5), (64, 256, 64, 1, 8, 4), (32, 128, 256, 1, 8, 3),
]
GEMV_CANDIDATES = [  # (block_n, block_k, num_warps, num_stages): the path for a few pairs
    (16, 256, 4, 3), (32, 256, 4, 3), (8, 512, 4, 2), (16, 512, 4, 2), (32, 128, 4, 4), (64, 128, 4, 3),
    (32, 512, 8, 2), (64, 256, 8, 3), (4, 1024, 4, 2),
    # more programs for a down GEMV whose pairs sum in one program (a token's k experts, shared ones included)
    (8, 256, 4, 3), (4, 512, 4, 3), (8, 1024, 4, 2),
]
DOWN_GEMV_CANDIDATES = [  # the down GEMV only: each K-step of every pair of a token in one tile (pairs_at_once)
    (8, 128, 4, 3, True), (4, 256, 4, 3, True), (8, 64, 4, 4, True), (16, 64, 4, 3, True), (4, 128, 4, 4, True),
    (16, 128, 8, 3, True),
    # two or one output columns a program: a token's 8 pairs x 128-wide K-steps are still 1-2k elements a tile, and
    # the grid has 2-4x the programs (deepseek-v2-lite, one token, cold: 12.9 us at (2, 128) against 21.4 at (4, 128))
    (2, 128, 4, 3, True), (2, 64, 4, 4, True), (2, 256, 4, 3, True), (1, 256, 4, 3, True), (2, 128, 2, 3, True),
]
GEMV_MAX_PAIRS = 64
MAX_COPIES = 8  # weight copies (and routings) a candidate cycles through where one launch would fit in L2


def copies_for(num_tokens: int, top_k: int, num_experts: int, down_bytes: int, l2_bytes: int) -> int:
    """How many (weight copy, routing) pairs a candidate cycles through so that no launch finds its experts in L2:
    enough that one launch of the smaller GEMM (down: down_bytes an expert) on every copy reads 4x the L2 cache;
    1 where one launch already does. At most MAX_COPIES."""
    touched = min(num_experts, num_tokens * top_k) * down_bytes
    return max(1, min(MAX_COPIES, -(-4 * l2_bytes // touched)))


def _routing(num_tokens: int, num_experts: int, top_k: int, num_shared: int,
             device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random routing over the routed experts, then the shared ones (experts num_experts.., weight 1) as a
    DeepSeek layer calls the kernel."""
    logits = torch.randn(num_tokens, num_experts, device=device)
    weights, ids = moe.route_softmax_topk(logits, top_k, renormalize=True)  # [T, k] each
    shared = torch.arange(num_experts, num_experts + num_shared, dtype=torch.int32, device=device)
    return (torch.cat((weights, weights.new_ones(num_tokens, num_shared)), 1),
            torch.cat((ids, shared.expand(num_tokens, num_shared)), 1))  # [T, k + S] each


Routings = list[tuple[torch.Tensor, torch.Tensor]]  # (weights [T, k], ids [T, k]) per launch
Weights = tuple[torch.Tensor, torch.Tensor | None]  # one GEMM's experts [E, N, K] and, e4m3, their scales [E, N, G]


def quantize_experts(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N, K / group_k]): per output row (and group_k columns: DeepSeek-V3's
    128-wide blocks), as --quantization fp8 stores experts."""
    num_experts, rows, cols = w.shape
    q, scale = ref.quantize_fp8_rows(w.reshape(num_experts * rows, cols), group_k)
    return q.view(num_experts, rows, cols), scale.view(num_experts, rows, -1)


def _gemm_runner(x: torch.Tensor, ws: list[Weights], routings: Routings, fuse_silu: bool, tile: moe.TileConfig,
                 num_experts: int, group_k: int | None = None) -> list[Callable[[], torch.Tensor]]:
    """One of the two grouped GEMMs with this tile (its alignment included: it is part of the layer's cost), one
    launch per (weight copy, routing); e4m3 weights W8A8 where the tile says act_fp8, else weight-only."""
    top_k = routings[0][1].shape[1]
    num_pairs = routings[0][1].numel()
    n = ws[0][0].shape[1] // 2 if fuse_silu else ws[0][0].shape[1]
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)

    def run(w: Weights, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        align = moe.align_pairs(ids, num_experts, tile.block_m)
        moe._moe_gemm(x, w[0], w[1], group_k or w[0].shape[2], align, out, num_pairs, top_k if fuse_silu else 1,
                      fuse_silu, None if fuse_silu else weights.reshape(-1), tile, tile.act_fp8)
        return out  # [T * k, N] in pair order
    return [functools.partial(run, w, weights, ids) for w, (weights, ids) in zip(ws, routings, strict=True)]


def _gemv_runner(x: torch.Tensor, ws: list[Weights], routings: Routings, fuse_silu: bool, tile: moe.GemvConfig,
                 group_k: int | None = None) -> list[Callable[[], None]]:
    top_k = routings[0][1].shape[1]
    n = ws[0][0].shape[1] // 2 if fuse_silu else ws[0][0].shape[1]
    out = torch.empty(routings[0][1].numel(), n, dtype=x.dtype, device=x.device)

    def run(w: Weights, weights: torch.Tensor, ids: torch.Tensor) -> None:
        moe._moe_gemv(x, w[0], w[1], group_k or w[0].shape[2], ids, out, top_k if fuse_silu else 1, fuse_silu,
                      None if fuse_silu else weights.reshape(-1), tile)
    return [functools.partial(run, w, weights, ids) for w, (weights, ids) in zip(ws, routings, strict=True)]


def gemm_candidates(fp8: bool, group_k: int | None, k: int) -> list[moe.TileConfig]:
    """The grouped-GEMM tiles to time for one GEMM over rows of k: CANDIDATES, for FP8 experts each both
    weight-only and W8A8, a K block inside one scale group (as fused_experts fits it), no tile twice."""
    tiles = [moe.TileConfig(*c) for c in CANDIDATES]
    if fp8:
        tiles = [moe._fit_block_k(t, group_k or k, k) for t in tiles]
        tiles += [replace(t, act_fp8=True) for t in tiles]
    return list(dict.fromkeys(tiles))


def _best(runners: dict[Any, list[Callable[[], object]]]) -> tuple[float, Any]:
    """(ms a launch, key) of the fastest runner (its launches back to back in one graph); candidates that do not
    compile (shared memory) are skipped."""
    best: tuple[float, Any] | None = None
    for key, run in runners.items():
        try:
            ms = graph_time_ms(run, reps=10)
        except Exception as exc:  # noqa: BLE001
            print(f"  skip {key}: {type(exc).__name__}", flush=True)
            continue
        if best is None or ms < best[0]:
            best = (ms, key)
    assert best is not None
    return best


def gemv_candidates(group_k: int | None, k: int, fuse_silu: bool) -> list[moe.GemvConfig]:
    """The GEMV tiles to time for one GEMV over rows of k (the down GEMV's pairs-at-once ones too), each K block
    inside one FP8 scale group where there are groups (as fused_experts fits it), none twice."""
    tiles = [moe.GemvConfig(*c) for c in GEMV_CANDIDATES + ([] if fuse_silu else DOWN_GEMV_CANDIDATES)]
    if group_k:
        tiles = [moe._fit_gemv_block_k(t, group_k, k) for t in tiles]
    return list(dict.fromkeys(tiles))


def layer_dims(name: str) -> tuple[int, int, int, int, int]:
    """(hidden, expert intermediate, experts, experts a token, shared experts) of one sparse layer as the model calls
    the kernel: DeepSeek's and Qwen2-MoE's shared experts run in the same call as experts E.. (models/deepseek.py,
    moe.py), so they are tuned as part of it."""
    arch = SHAPES[name]
    assert arch.moe is not None, f"{name} is not a mixture-of-experts shape"
    spec = arch.moe
    num_shared = (fused_shared_experts(spec, spec.expert_intermediate_size, None)
                  or fused_gated_shared_experts(spec, None))
    return (arch.hidden_size, spec.expert_intermediate_size, spec.num_experts + num_shared, spec.top_k + num_shared,
            num_shared)


def compile_gemm_tiles(name: str, fp8: bool, group_k: int | None, dtype_name: str,
                       entries: list[dict[str, Any]], device_name: str = "cuda") -> int:
    """Launch both grouped GEMMs once with each tile (64 tokens, uninitialised weights of the layer's shape) so that
    Triton's on-disk cache holds their code before tune_shape times them; run in spawned processes (precompile).
    Returns how many launched (a tile out of shared memory does not: tune_shape skips it)."""
    h, i, e, k, num_shared = layer_dims(name)
    spec = SHAPES[name].moe
    assert spec is not None
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)

    def weights(rows: int, cols: int) -> Weights:
        if not fp8:
            return torch.empty(e, rows, cols, dtype=dtype, device=device), None
        scales = torch.ones(e, rows, cols // (group_k or cols), device=device)
        return torch.empty(e, rows, cols, dtype=torch.float8_e4m3fn, device=device), scales
    routings = [_routing(64, spec.num_experts, spec.top_k, num_shared, device)]
    operands = ((torch.zeros(64, h, dtype=dtype, device=device), weights(2 * i, h), True),
                (torch.zeros(64 * k, i, dtype=dtype, device=device), weights(h, i), False))
    launched = 0
    for entry in entries:
        for a, w, fuse in operands:
            try:
                _gemm_runner(a, [w], routings, fuse, moe.TileConfig(**entry), e, group_k)[0]()
                launched += 1
            except Exception:  # noqa: BLE001 - out of shared memory or registers: tune_shape skips it
                continue
    if device.type == "cuda":
        torch.cuda.synchronize()
    return launched


def precompile(name: str, fp8: bool, group_k: int | None, dtype: torch.dtype, jobs: int) -> int:
    """Compile every grouped-GEMM candidate of one shape in `jobs` spawned processes (each its own CUDA context)
    before tune_shape times them: serially the compiles dominate an FP8 tuning (twice the candidates, two GEMMs)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    h, i = layer_dims(name)[:2]
    entries = [asdict(t) for t in dict.fromkeys(gemm_candidates(fp8, group_k, h) + gemm_candidates(fp8, group_k, i))]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as running:
        futures = [running.submit(compile_gemm_tiles, name, fp8, group_k, str(dtype).removeprefix("torch."),
                                  entries[part::jobs]) for part in range(jobs)]
        return sum(future.result() for future in futures)


def tune_shape(name: str, dtype: torch.dtype, device: torch.device, buckets: tuple[int, ...], fp8: bool = False,
               group_k: int | None = None) -> dict[str, Any]:
    """One shape's table over the buckets (fp8: e4m3 experts with per-row, or group_k-block, scales; activations in
    dtype), each bucket's tuned layer measured (_measure)."""
    arch = SHAPES[name]
    spec = arch.moe
    h, i, e, k, num_shared = layer_dims(name)
    assert spec is not None
    w_gate_up = (torch.randn(e, 2 * i, h, device=device) * 0.02).to(dtype)  # [E, 2I, H]
    w_down = (torch.randn(e, h, i, device=device) * 0.02).to(dtype)  # [E, H, I]
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    down_bytes = h * i * (1 if fp8 else w_down.element_size())
    copies_needed = max(copies_for(b, k, e, down_bytes, l2_bytes) for b in buckets)
    up: Weights = quantize_experts(w_gate_up, group_k) if fp8 else (w_gate_up, None)
    down: Weights = quantize_experts(w_down, group_k) if fp8 else (w_down, None)
    up_copies = [up] + [_clone(up) for _ in range(copies_needed - 1)]
    down_copies = [down] + [_clone(down) for _ in range(copies_needed - 1)]
    table: dict[int, dict[str, Any]] = {}
    rows = []
    for num_tokens in buckets:
        x = torch.randn(num_tokens, h, device=device).to(dtype)
        copies = copies_for(num_tokens, k, e, down_bytes, l2_bytes)
        routings = [_routing(num_tokens, spec.num_experts, spec.top_k, num_shared, device) for _ in range(copies)]
        weights, ids = routings[0]
        act = torch.randn(num_tokens * k, i, device=device).to(dtype)
        operands = (("gate_up", x, up_copies[:copies], True, h), ("down", act, down_copies[:copies], False, i))
        best = {which: _best({t: _gemm_runner(a, ws, routings, fuse, t, e, group_k)
                              for t in gemm_candidates(fp8, group_k, width)})
                for which, a, ws, fuse, width in operands}
        tiles: moe.Tiles = (best["gate_up"][1], best["down"][1])
        if ids.numel() <= GEMV_MAX_PAIRS:
            gemv = {which: _best({t: _gemv_runner(a, ws, routings, fuse, t, group_k)
                                  for t in gemv_candidates(group_k if fp8 else None, width, fuse)})
                    for which, a, ws, fuse, width in operands}
            if gemv["gate_up"][0] + gemv["down"][0] < best["gate_up"][0] + best["down"][0]:
                best, tiles = gemv, (gemv["gate_up"][1], gemv["down"][1])
        table[num_tokens] = moe.tiles_to_json(tiles)
        rows.append(_measure(x, (w_gate_up, w_down), (up, down), group_k, weights, ids, tiles, arch, num_tokens,
                             (best["gate_up"][0], best["down"][0])))
        print(json.dumps(rows[-1]), flush=True)
    table_dtype = moe.FP8_TABLE_DTYPE if fp8 else str(dtype).removeprefix("torch.")
    return {"shape": name, "table": table, "rows": rows,
            "file": moe.config_file_name(e, i, h, table_dtype, torch.cuda.get_device_name())}


def _clone(w: Weights) -> Weights:
    return w[0].clone(), None if w[1] is None else w[1].clone()


def _measure(x: torch.Tensor, unquantized: tuple[torch.Tensor, torch.Tensor], served: tuple[Weights, Weights],
             group_k: int | None, weights: torch.Tensor, ids: torch.Tensor, tiles: moe.Tiles, arch: Any,
             num_tokens: int, best_ms: tuple[float, float]) -> dict[str, Any]:
    """The whole tuned layer (both GEMMs, alignment, top-k sum) on the weights as served (e4m3 with scales, or as
    they are): time, bandwidth on the experts it reads, matmul rate, and its error against the reference on the
    unquantized weights (FP8 experts: e4m3's ~5%, W8A8 or not)."""
    spec = arch.moe
    h, i = arch.hidden_size, spec.expert_intermediate_size
    (w_gate_up, up_scale), (w_down, down_scale) = served
    num_experts, top_k = w_gate_up.shape[0], ids.shape[1]  # shared experts included

    def layer() -> torch.Tensor:
        return moe.fused_experts(x, w_gate_up, w_down, weights, ids, up_scale, down_scale, group_k, tiles=tiles)
    ms = graph_time_ms(layer)
    touched = int(ids.unique().numel())
    expert_bytes = touched * 3 * h * i * w_gate_up.element_size()
    flops = 2 * num_tokens * top_k * 3 * h * i
    expected = ref.moe_experts(x, *unquantized, weights, ids).float()
    rel_err = ((layer().float() - expected).norm() / expected.norm()).item()
    return {"shape": arch.model_type, "tokens": num_tokens, "ms": round(ms, 4), "experts_touched": touched,
            "hbm_fraction": round(expert_bytes / (ms * 1e-3) / HBM_BYTES_PER_S, 3),
            "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
            "matmul_fraction": round(flops / (ms * 1e-3) / MATMUL_FLOPS, 3), "rel_err": rel_err,
            "gate_up_ms": round(best_ms[0], 4), "down_ms": round(best_ms[1], 4),
            "gate_up_tile": asdict(tiles[0]), "down_tile": asdict(tiles[1]),
            "path": "gemv" if isinstance(tiles[0], moe.GemvConfig) else "grouped gemm",
            "align_ms": {"triton": round(graph_time_ms(lambda: moe.align_pairs_triton(ids, num_experts, 64)), 4),
                         "sorted": round(graph_time_ms(lambda: moe.align_pairs_sorted(ids, num_experts, 64)), 4)}}


def merge_table(committed: dict[str, Any], tuned: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The committed table with the tuned buckets replaced or added, buckets in increasing order."""
    merged = {int(bucket): entry for bucket, entry in committed.items()} | tuned
    return {str(bucket): merged[bucket] for bucket in sorted(merged)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    parser.add_argument("--dtype", default="bfloat16", help="the activations' (and unquantized weights') dtype")
    parser.add_argument("--weights", choices=("model", "fp8"), default="model",
                        help="fp8: e4m3 experts, weight-only and W8A8 tiles, into the FP8 table")
    parser.add_argument("--group-k", type=int, default=None, help="FP8 scale blocks of this many columns "
                        "(DeepSeek-V3: 128); default one scale per row")
    parser.add_argument("--write", action="store_true", help="store the tables under kernels/moe_configs/")
    parser.add_argument("--compile-jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes compiling the grouped-GEMM candidates first (1: compile while timing)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "tuning needs a GPU"
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    torch.manual_seed(0)
    started = time.perf_counter()
    fp8 = args.weights == "fp8"
    results = []
    for name in args.shapes.split(","):
        if args.compile_jobs > 1:
            compiled_at = time.perf_counter()
            launched = precompile(name, fp8, args.group_k, dtype, args.compile_jobs)
            print(f"precompiled {name}: {launched} GEMM launches in {time.perf_counter() - compiled_at:.0f} s "
                  f"({args.compile_jobs} processes)", flush=True)
        results.append(tune_shape(name, dtype, device, buckets, fp8, args.group_k))
    for result in results:
        if args.write:
            moe.CONFIG_DIR.mkdir(exist_ok=True)
            path = moe.CONFIG_DIR / result["file"]
            merged = merge_table(json.loads(path.read_text()) if path.is_file() else {}, result["table"])
            path.write_text(json.dumps(merged, indent=1) + "\n")
        print(f"\n{result['shape']}: {result['file']}")
        print(f"{'tokens':>7}{'ms':>9}{'experts':>9}{'HBM':>7}{'TFLOP/s':>9}{'peak':>7}{'rel err':>10}"
              f"{'align triton/sort ms':>22}  path")
        for row in result["rows"]:
            align = row["align_ms"]
            print(f"{row['tokens']:>7}{row['ms']:>9.3f}{row['experts_touched']:>9}{row['hbm_fraction']:>7.0%}"
                  f"{row['tflops']:>9.1f}{row['matmul_fraction']:>7.0%}{row['rel_err']:>10.1e}"
                  f"{align['triton']:>12.3f}/{align['sorted']:<9.3f}  {row['path']}")
    print(f"tuned in {time.perf_counter() - started:.0f} s")
    if args.out:
        write_json(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
