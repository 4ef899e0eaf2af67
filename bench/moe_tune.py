"""Tune the fused MoE kernel's tiles per token-count bucket on this GPU, check it against the reference, and report
what the tuned kernel reaches: HBM bandwidth on the expert bytes it reads (small batches) and bf16 matmul rate
(large ones).

    python -m pagoda.bench.moe_tune --shapes qwen3-30b-a3b,mixtral-8x7b [--write] [--out results.json]

--write stores the table under kernels/moe_configs/ (named by experts, sizes, dtype, device and Triton version),
where kernels/moe.py looks it up at run time; a committed table's other buckets are kept (--buckets 1,2 retunes
those two only).

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
import time
from collections.abc import Callable
from dataclasses import asdict
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


def _gemm_runner(x: torch.Tensor, ws: list[torch.Tensor], routings: Routings, fuse_silu: bool,
                 tile: moe.TileConfig, num_experts: int) -> list[Callable[[], None]]:
    """One of the two grouped GEMMs with this tile (its alignment included: it is part of the layer's cost), one
    launch per (weight copy, routing)."""
    top_k = routings[0][1].shape[1]
    num_pairs = routings[0][1].numel()
    n = ws[0].shape[1] // 2 if fuse_silu else ws[0].shape[1]
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)

    def run(w: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
        align = moe.align_pairs(ids, num_experts, tile.block_m)
        moe._moe_gemm(x, w, None, None, align, out, num_pairs, top_k if fuse_silu else 1, fuse_silu,
                      None if fuse_silu else weights.reshape(-1), tile)
    return [functools.partial(run, w, weights, ids) for w, (weights, ids) in zip(ws, routings, strict=True)]


def _gemv_runner(x: torch.Tensor, ws: list[torch.Tensor], routings: Routings, fuse_silu: bool,
                 tile: moe.GemvConfig) -> list[Callable[[], None]]:
    top_k = routings[0][1].shape[1]
    n = ws[0].shape[1] // 2 if fuse_silu else ws[0].shape[1]
    out = torch.empty(routings[0][1].numel(), n, dtype=x.dtype, device=x.device)

    def run(w: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
        moe._moe_gemv(x, w, None, w.shape[2], ids, out, top_k if fuse_silu else 1, fuse_silu,
                      None if fuse_silu else weights.reshape(-1), tile)
    return [functools.partial(run, w, weights, ids) for w, (weights, ids) in zip(ws, routings, strict=True)]


def _best(runners: dict[Any, list[Callable[[], None]]]) -> tuple[float, Any]:
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


def tune_shape(name: str, dtype: torch.dtype, device: torch.device, buckets: tuple[int, ...]) -> dict[str, Any]:
    arch = SHAPES[name]
    assert arch.moe is not None, f"{name} is not a mixture-of-experts shape"
    spec = arch.moe
    # DeepSeek's and Qwen2-MoE's shared experts run in the same call as experts E.. (models/deepseek.py, moe.py):
    # tune that shape
    num_shared = (fused_shared_experts(spec, spec.expert_intermediate_size, None)
                  or fused_gated_shared_experts(spec, None))
    h, i = arch.hidden_size, spec.expert_intermediate_size
    e, k = spec.num_experts + num_shared, spec.top_k + num_shared
    w_gate_up = (torch.randn(e, 2 * i, h, device=device) * 0.02).to(dtype)  # [E, 2I, H]
    w_down = (torch.randn(e, h, i, device=device) * 0.02).to(dtype)  # [E, H, I]
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    down_bytes = h * i * w_down.element_size()
    copies_needed = max(copies_for(b, k, e, down_bytes, l2_bytes) for b in buckets)
    up_copies = [w_gate_up] + [w_gate_up.clone() for _ in range(copies_needed - 1)]
    down_copies = [w_down] + [w_down.clone() for _ in range(copies_needed - 1)]
    table: dict[int, dict[str, Any]] = {}
    rows = []
    for num_tokens in buckets:
        x = torch.randn(num_tokens, h, device=device).to(dtype)
        copies = copies_for(num_tokens, k, e, down_bytes, l2_bytes)
        routings = [_routing(num_tokens, spec.num_experts, spec.top_k, num_shared, device) for _ in range(copies)]
        weights, ids = routings[0]
        act = torch.randn(num_tokens * k, i, device=device).to(dtype)
        operands = (("gate_up", x, up_copies[:copies], True), ("down", act, down_copies[:copies], False))
        best = {which: _best({moe.TileConfig(*c): _gemm_runner(a, ws, routings, fuse, moe.TileConfig(*c), e)
                              for c in CANDIDATES})
                for which, a, ws, fuse in operands}
        tiles: moe.Tiles = (best["gate_up"][1], best["down"][1])
        if ids.numel() <= GEMV_MAX_PAIRS:
            gemv = {which: _best({moe.GemvConfig(*c): _gemv_runner(a, ws, routings, fuse, moe.GemvConfig(*c))
                                  for c in GEMV_CANDIDATES + ([] if fuse else DOWN_GEMV_CANDIDATES)})
                    for which, a, ws, fuse in operands}
            if gemv["gate_up"][0] + gemv["down"][0] < best["gate_up"][0] + best["down"][0]:
                best, tiles = gemv, (gemv["gate_up"][1], gemv["down"][1])
        table[num_tokens] = moe.tiles_to_json(tiles)
        rows.append(_measure(x, w_gate_up, w_down, weights, ids, tiles, arch, num_tokens,
                             (best["gate_up"][0], best["down"][0])))
        print(json.dumps(rows[-1]), flush=True)
    return {"shape": name, "table": table, "rows": rows,
            "file": moe.config_file_name(e, i, h, str(dtype).removeprefix("torch."), torch.cuda.get_device_name())}


def _measure(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, tiles: moe.Tiles, arch: Any,
             num_tokens: int, best_ms: tuple[float, float]) -> dict[str, Any]:
    """The whole tuned layer (both GEMMs, alignment, top-k sum): time, bandwidth on the experts it reads, matmul
    rate, and its error against the reference."""
    spec = arch.moe
    h, i = arch.hidden_size, spec.expert_intermediate_size
    num_experts, top_k = w_gate_up.shape[0], ids.shape[1]  # shared experts included
    ms = graph_time_ms(lambda: moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=tiles))
    touched = int(ids.unique().numel())
    expert_bytes = touched * 3 * h * i * x.element_size()
    flops = 2 * num_tokens * top_k * 3 * h * i
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=tiles).float()
    expected = ref.moe_experts(x, w_gate_up, w_down, weights, ids).float()
    rel_err = ((got - expected).norm() / expected.norm()).item()
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
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--write", action="store_true", help="store the tables under kernels/moe_configs/")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "tuning needs a GPU"
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    torch.manual_seed(0)
    started = time.perf_counter()
    results = [tune_shape(name, dtype, device, buckets) for name in args.shapes.split(",")]
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
