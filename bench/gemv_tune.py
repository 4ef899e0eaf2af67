"""The 16-bit GEMV (kernels/gemv.py, PAGODA_DENSE_GEMV=1) on one GPU: tune its tiles per linear layer and M bucket
(1 to 256 rows) against torch's linear (cuBLAS), and keep it only where it wins.

    python -m pagoda.bench.gemv_tune [--models llama3-8b,qwen3-0.6b,deepseek-v2-lite] [--buckets 1,2,4,8]
        [--layers aq,o] [--compile-jobs 16] [--out $OUT]

For every bf16 linear layer of the models (attention projections, a dense MLP where the model has one;
linear_shapes), every candidate tile set of the W8A16 tuner that multiplies 16-bit weights (bench/fp8_tune.candidates
less its act_fp8 tiles: FMA rows up to 4, tensor-core tiles from 2, swap_ab tiles from 8, 64-128-row tiles with
split-K above 32) is checked against torch's linear, then timed as decode runs it: replayed from a CUDA graph cycling
through enough weight copies (>= 256 MB) that none is in L2. The best is kept where it beats cuBLAS by 3%, else the
entry says "cublas" and the layer stays on torch's linear. The best tiles are also timed launched as a single-token
step launches them under PAGODA_DENSE_GEMV=1 (programmatic dependent launch, each launch overlapping the previous
one's tail: `chained_us`), which cuBLAS cannot do. The committed table's entries for other buckets are kept.
Every candidate of a layer is compiled first in --compile-jobs spawned processes (fp8_tune.precompile: serially,
a decode bucket's ~114 tensor-core tile sets a layer take minutes to compile); --layers keeps the named layers.

Writes gemv_tune.json (every row) and dense_table.json (commit it as
kernels/gemv_configs/dense,device=<GPU name>,triton=<version>.json) under --out or $OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.fp8_tune import ROTATE_BYTES, W8A8_MARGIN, _cosine, _in_pdl_chain, candidates, precompile, rotating_us
from pagoda.bench.report import write_json
from pagoda.kernels.fp8_weight_only import M_BUCKETS
from pagoda.shared.shapes import SHAPES, ModelArch

BUCKETS = M_BUCKETS  # 1 .. 256 rows: kernels/gemv.MAX_TUNED_ROWS


def dense_candidates(bucket: int) -> list[Any]:
    """The W8A16 tuner's tiles that take 16-bit weights (launch_gemv refuses act_fp8 tiles without scales)."""
    return [tiles for tiles in candidates(bucket) if not tiles.act_fp8]


def linear_shapes(arch: ModelArch) -> list[tuple[str, int, int]]:
    """(name, N, K) of the model's 16-bit linear layers outside the experts, as the model stores them fused: qkv
    (or DeepSeek's [kv_a ‖ q] / a and q), o, the dense MLP's gate_up and down where some layer has one. Not the LM
    head: it stays on torch's linear (CausalLM.compute_logits)."""
    h = arch.hidden_size
    if arch.mla is None:
        shapes = [("qkv", arch.q_size + 2 * arch.kv_size, h), ("o", h, arch.q_size)]
    else:
        mla = arch.mla
        q = arch.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            shapes = [("aq", mla.entry_dim + q, h)]
        else:
            shapes = [("a", mla.q_lora_rank + mla.entry_dim, h), ("q", q, mla.q_lora_rank)]
        shapes.append(("o", h, arch.num_heads * mla.v_head_dim))
    if arch.moe is None or len(arch.moe.sparse_layers) < arch.num_layers:
        shapes += [("gate_up", 2 * arch.intermediate_size, h), ("down", h, arch.intermediate_size)]
    return shapes


def compile_dense_tiles(n: int, k: int, bucket: int, tiles: list[dict[str, Any]]) -> int:
    """fp8_tune.compile_tiles for the 16-bit GEMV: launch it once with each tile set at (M=bucket, N=n, K=k) as
    tune_layer launches it (bf16, contiguous), filling Triton's on-disk cache; a tile set the device refuses is
    skipped. Returns how many launched."""
    from pagoda.kernels import gemv
    from pagoda.kernels.fp8_weight_only import tiles_from_json

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.zeros(bucket, k, dtype=torch.bfloat16, device=device)  # [M, K]
    weight = torch.zeros(n, k, dtype=torch.bfloat16, device=device)  # [N, K]
    launched = 0
    for entry in tiles:
        try:
            gemv.dense_gemv(x, weight, tiles=tiles_from_json(entry))
            launched += 1
        except Exception:  # noqa: BLE001 - out of shared memory or registers: tune_layer reports it
            continue
    return launched


def _copies(n: int, k: int) -> list[torch.Tensor]:
    weight = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()  # [N, K]
    count = max(2, min(16, -(-ROTATE_BYTES // (2 * n * k))))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def tune_layer(name: str, n: int, k: int, buckets: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per bucket: the best tiles, their time, cuBLAS's, the chained time, and the choice."""
    import torch.nn.functional as F

    from pagoda.kernels import gemv

    weights = _copies(n, k)
    rows = []
    for bucket in buckets:
        x = torch.randn(bucket, k, device="cuda").bfloat16()  # [M, K]
        expected = F.linear(x.float(), weights[0].float())  # [M, N]
        best: tuple[float, Any] | None = None
        for tiles in dense_candidates(bucket):
            try:
                out = gemv.dense_gemv(x, weights[0], tiles=tiles)
            except Exception as exc:  # a tile set this GPU cannot compile (shared memory, registers): skip it
                print(f"  {name} M={bucket} {tiles}: {type(exc).__name__}")
                continue
            if _cosine(out, expected) < 0.9999:
                raise AssertionError(f"{name} M={bucket} {tiles}: cosine {_cosine(out, expected):.6f}")
            us = rotating_us(gemv.dense_gemv, x, weights, None, tiles=tiles)
            if best is None or us < best[0]:
                best = (us, tiles)
        assert best is not None
        cublas_us = rotating_us(F.linear, x, weights, None)
        chained_us = rotating_us(_in_pdl_chain(gemv.dense_gemv), x, weights, None, tiles=best[1])
        choice = "gemv" if best[0] < W8A8_MARGIN * cublas_us else "cublas"
        row = {"layer": name, "N": n, "K": k, "M": bucket, "tiles": dataclasses.asdict(best[1]), "gemv_us": best[0],
               "chained_us": chained_us, "cublas_us": cublas_us, "choice": choice,
               "gemv_TBps": 2 * n * k / best[0] / 1e6, "cublas_TBps": 2 * n * k / cublas_us / 1e6}
        print(f"tune {name:8s} N={n:6d} K={k:6d} M={bucket}: gemv {best[0]:7.1f} us ({row['gemv_TBps']:.2f} TB/s; "
              f"chained {chained_us:7.1f}) cublas {cublas_us:7.1f} us ({row['cublas_TBps']:.2f} TB/s) -> {choice} "
              f"{best[1]}", flush=True)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama3-8b,qwen3-0.6b,deepseek-v2-lite",
                        help="comma-separated dummy shapes (pagoda.shared.shapes.SHAPES)")
    parser.add_argument("--buckets", default="1,2,4,8", help=f"M buckets, of {BUCKETS}")
    parser.add_argument("--layers", default="", help="comma-separated layer names (linear_shapes); default all")
    parser.add_argument("--compile-jobs", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling a layer's candidates before they are timed (1: none)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/gemv_tune"))
    args = parser.parse_args()
    from pagoda.kernels import gemv

    buckets = tuple(int(b) for b in args.buckets.split(","))
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown or not set(buckets) <= set(BUCKETS):
        parser.error(f"--models must be among {sorted(SHAPES)} and --buckets among {BUCKETS}")
    if not torch.cuda.is_available():
        parser.error("gemv_tune needs a CUDA GPU")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    path = gemv.CONFIG_DIR / gemv.config_name(device.replace(" ", "_"))
    table: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    started = time.time()
    rows: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for model in args.models.split(","):
        for name, n, k in linear_shapes(SHAPES[model]):
            if (n, k) in seen or (args.layers and name not in args.layers.split(",")):
                continue
            seen.add((n, k))
            if args.compile_jobs > 1:
                compiled_at = time.time()
                launched = precompile(n, k, buckets, "all", args.compile_jobs, compile_fn=compile_dense_tiles,
                                      candidates_of=dense_candidates)
                print(f"precompiled {model} {name}: {launched} tile sets in {time.time() - compiled_at:.0f} s "
                      f"({args.compile_jobs} processes)", flush=True)
            for row in tune_layer(name, n, k, buckets):
                rows.append({"model": model, **row})
                table[f"{n},{k},{row['M']}"] = {"cublas": True} if row["choice"] == "cublas" else row["tiles"]
    (out_dir / "dense_table.json").write_text(json.dumps(table, indent=1, sort_keys=True))
    wins = [r for r in rows if r["choice"] == "gemv"]
    print(f"tuned in {time.time() - started:.0f} s; the GEMV beats cuBLAS at {len(wins)} of {len(rows)} "
          f"(layer, M): " + ", ".join(f"{r['model']} {r['layer']} M={r['M']} {r['cublas_us'] / r['gemv_us']:.2f}x"
                                      for r in wins))
    write_json(out_dir / "gemv_tune.json", {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                            "device": device, "torch": torch.__version__, "table": table,
                                            "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
