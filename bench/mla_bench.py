"""MLA kernels on one GPU (kernels/mla.py), DeepSeek dims (kv_lora_rank 512, rope 64, nope 128, v 128):

  decode   absorbed decode at B = 1, 64, 256 x context 1k / 4k, 16 heads (V2-Lite) and 128 heads (V3), bf16 and
           fp8 latent cache, the default launch shape and the first version's (legacy): device time from a CUDA
           graph (caches under 2x L2 cycled over copies), latent-cache TB/s against 4.2 TB/s and TFLOP/s against
           780; --sweep tries launch shapes at B = 256, 1k.
  prefill  one chunk of q_len queries after `context` cached tokens, the whole attention of each path (absorbed:
           W_UK bmm + kernel + W_UV bmm; expanded: gather + kv_b GEMM + attention), device time with the host ahead
           as in a prefill forward: the crossover query length to put in kernels/mla.py EXPAND_CROSSOVER; then
           whole prefill steps (several 512-query chunks in one launch).
  lazy     the default decode launch with the softmax sums per key slot against without (--parts lazy).
  capacity KV blocks per GiB of the latent cache (the worker's layout) against the same model with per-head K/V.

    python -m pagoda.bench.mla_bench [--parts decode,prefill,capacity,lazy] [--sweep] [--quick] [--out FILE]
    python -m pagoda.bench.mla_bench --parts none --sweep    # the decode launch-shape sweep alone
    python -m pagoda.bench.mla_bench --smoke    # tiny shapes on CPU (Triton interpreter): checks the script runs

Every timed configuration is first checked against the PyTorch reference. JSON goes to --out, else to
$OUT/mla_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pagoda.bench.cuda_timing import flushed_time_ms, queued_time_ms
from pagoda.bench.interpreter import use_interpreter
from pagoda.bench.report import write_report

PEAK_BYTES_PER_S = 4.2e12  # measured HBM bandwidth of an H200 (DESIGN.md)
PEAK_FLOPS = 780e12  # measured dense bf16 matmul rate of an H200


@dataclass(frozen=True)
class Dims:
    num_heads: int
    lat: int = 512  # kv_lora_rank
    rope: int = 64  # qk_rope_head_dim
    nope: int = 128  # qk_nope_head_dim
    v_dim: int = 128  # v_head_dim
    block_size: int = 16

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5


SMOKE_DIMS = Dims(num_heads=4, lat=32, rope=16, nope=16, v_dim=16, block_size=8)


def _time_us(fn: Any, device: str, iters: int) -> float:
    """Median time of one call after warm-up, L2 wiped before each (CUDA events); on CPU wall time."""
    if device != "cuda":
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    return flushed_time_ms(fn, iters, warmup=3) * 1e3


def _paged_cache(dims: Dims, seq_lens: list[int], dtype: torch.dtype, device: str,
                 kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent cache holding the sequences' entries in shuffled blocks, and their block tables."""
    from pagoda.kernels import reference as ref

    bs = dims.block_size
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache = torch.randn(num_blocks, bs, dims.lat + dims.rope, device=device)  # [N, bs, R + P]
    cache = ref.quantize_fp8(cache, kv_scale) if dtype == torch.float8_e4m3fn else cache.to(dtype)
    perm = torch.randperm(num_blocks, device=device).int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    return cache, tables


def _check(out: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    err = (out.float().cpu() - expected.float().cpu()).abs().max().item()
    if not err < 3e-2:
        raise AssertionError(f"{what}: max abs err {err:.3e} against the reference")
    return err


# ---------------------------------------------------------------------------------------------- decode


L2_BYTES = 50 << 20  # an H200's L2: small caches are cycled over copies so that replays read HBM, not L2
MAX_COPIES = 8


def _graph_us(fns: list[Any]) -> float:
    """Device time of one call, from a CUDA graph that launches every fn of fns once (each over its own cache
    copy), replayed back to back: no host launch cost in the figure."""
    from pagoda.bench.cuda_timing import graph_time_ms

    return graph_time_ms(fns, reps=10) * 1e3


def decode_row(dims: Dims, batch: int, context: int, cache_dtype: torch.dtype, device: str, iters: int,
               config: Any = None, legacy: bool = False) -> dict[str, Any]:
    """Absorbed decode of `batch` sequences of `context` cached tokens: checked on a few rows against the
    reference, then timed (CUDA graph on the GPU). config None: the default pick (legacy: the first version's)."""
    from pagoda.kernels import reference as ref
    from pagoda.kernels.mla import mla_attention, pick_mla_config

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kv_scale = torch.tensor([0.05], device=device) if cache_dtype == torch.float8_e4m3fn else None
    cache, tables = _paged_cache(dims, [context] * batch, cache_dtype, device, kv_scale)
    q = torch.randn(batch, dims.num_heads, dims.lat + dims.rope, device=device).to(dtype) * 0.1  # [B, heads, R + P]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty(batch, dims.num_heads, dims.lat, dtype=dtype, device=device)
    used = config or pick_mla_config(batch, dims.num_heads, 1, context, legacy=legacy)
    cache_bytes = batch * context * (dims.lat + dims.rope) * cache.element_size()

    def call(cache_copy: torch.Tensor) -> torch.Tensor:
        return mla_attention(q, cache_copy, tables, seq_lens, qsl, 1, context, dims.scale, dims.lat, out=out,
                             config=used, kv_scale=kv_scale)

    check_rows = min(batch, 8)  # the reference on a few sequences (it is slow at B = 256)
    expected = ref.mla_attention(q[:check_rows].float(), cache, tables[:check_rows], [context] * check_rows,
                                 [1] * check_rows, dims.scale, dims.lat, kv_scale)
    err = _check(call(cache)[:check_rows], expected, f"decode B={batch} ctx={context}")
    if device == "cuda":
        copies = [cache] + [cache.clone() for _ in range(min(MAX_COPIES, -(-2 * L2_BYTES // cache_bytes)) - 1)]
        us = _graph_us([lambda c=c: call(c) for c in copies])
        del copies
    else:
        us = _time_us(lambda: call(cache), device, iters)
    flops = 2 * batch * context * dims.num_heads * (2 * dims.lat + dims.rope)
    return {"part": "decode", "heads": dims.num_heads, "B": batch, "context": context,
            "cache_dtype": str(cache_dtype).removeprefix("torch."), "us": us, "legacy": legacy,
            "cache_TBps": cache_bytes / us / 1e6, "hbm_fraction": cache_bytes / us / 1e6 / (PEAK_BYTES_PER_S / 1e12),
            "TFLOPs": flops / us / 1e6, "flop_fraction": flops / us / 1e6 / (PEAK_FLOPS / 1e12),
            "max_abs_err": err, "config": asdict(used)}


SWEEP = {  # (heads): launch shapes tried by --sweep at B = 256, ctx 1k, both cache dtypes
    16: [dict(decode_keys_m=k, decode_tile_n=n, decode_num_warps=w, decode_num_stages=st)
         for k, n, w, st in ((True, 32, 4, 3), (True, 32, 4, 2), (True, 64, 4, 2), (True, 64, 8, 2),
                             (True, 16, 4, 4), (False, 32, 8, 2), (False, 32, 4, 2), (False, 64, 8, 2))]
    # split-KV at B = 256 too: 256 one-head-block programs are ~2 per SM, each a serial walk of 1k keys
    + [dict(decode_keys_m=True, decode_tile_n=n, decode_num_warps=4, decode_num_stages=st, num_splits=sp)
       for n, st, sp in ((32, 3, 2), (32, 3, 4), (64, 2, 2), (16, 4, 2))],
    128: [dict(decode_tile_n=n, decode_num_warps=w, decode_num_stages=st)
          for n, w, st in ((32, 8, 3), (32, 8, 2), (16, 8, 3), (16, 8, 4), (64, 8, 2), (32, 16, 2))],
}


def decode_part(device: str, quick: bool, sweep: bool, smoke: bool, grid_rows: bool = True) -> list[dict[str, Any]]:
    from pagoda.kernels.mla import pick_mla_config

    rows = []
    if not grid_rows:
        grid = []
    elif smoke:
        grid = [(SMOKE_DIMS, 2, 40, torch.float32), (SMOKE_DIMS, 3, 40, torch.float8_e4m3fn)]
    else:
        grid = [(Dims(h), b, ctx, cd) for h in (16, 128) for b in (1, 64, 256) for ctx in (1024, 4096)
                for cd in (torch.bfloat16, torch.float8_e4m3fn)]
    iters = 2 if smoke else 10
    for dims, batch, ctx, cache_dtype in grid:
        for legacy in (False, True):
            row = decode_row(dims, batch, ctx, cache_dtype, device, iters, legacy=legacy)
            rows.append(row)
            _print_decode(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    if sweep and not smoke:
        for heads, variants in SWEEP.items():
            for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                base = pick_mla_config(256, heads, 1, 1024)
                best = None
                for variant in variants:
                    config = replace(base, **variant)
                    try:
                        row = decode_row(Dims(heads), 256, 1024, cache_dtype, device, 10, config)
                    except Exception as exc:  # noqa: BLE001 (a shape that does not compile: skip it)
                        print(f"sweep heads={heads} {variant}: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    row["part"] = "decode-sweep"
                    rows.append(row)
                    _print_decode(row, f"sweep {variant}")
                    if best is None or row["us"] < best["us"]:
                        best = row
                _sweep_batch_one(rows, heads, cache_dtype, device)
                if best is not None:
                    print(f"SWEEP best heads={heads} B=256 ctx=1024 {best['cache_dtype']}: {best['us']:.1f} us "
                          f"({best['cache_TBps']:.2f} TB/s, {best['TFLOPs']:.0f} TFLOP/s) with {best['config']}",
                          flush=True)
    return rows


def lazy_part(device: str, smoke: bool) -> list[dict[str, Any]]:
    """The default decode launch with its softmax sums per key slot (MLAConfig.decode_lazy_sum) and without, at
    B = 64 and 256, contexts 1k and 4k, 16 and 128 heads, both cache dtypes; the lazy row runs first (a row timed
    first in a process can read a few percent slow)."""
    from pagoda.kernels.mla import pick_mla_config

    rows = []
    grid = ([(SMOKE_DIMS, 3, 40, torch.float32)] if smoke else
            [(Dims(h), b, ctx, cd) for h in (16, 128) for b in (64, 256) for ctx in (1024, 4096)
             for cd in (torch.bfloat16, torch.float8_e4m3fn)])
    for dims, batch, ctx, cache_dtype in grid:
        base = pick_mla_config(batch, dims.num_heads, 1, ctx)
        for lazy in (True, False):
            row = decode_row(dims, batch, ctx, cache_dtype, device, 2 if smoke else 10,
                             replace(base, decode_lazy_sum=lazy))
            row["part"] = "decode-lazy" if lazy else "decode-eager"
            rows.append(row)
            _print_decode(row, "lazy sum" if lazy else "eager sum")
    return rows


def _sweep_batch_one(rows: list[dict[str, Any]], heads: int, cache_dtype: torch.dtype, device: str) -> None:
    """Batch 1, ctx 1k: how many KV splits (the default stops at 16: 16 of 132 SMs for 16 heads)."""
    from pagoda.kernels.mla import pick_mla_config

    base = pick_mla_config(1, heads, 1, 4096)
    for splits in (8, 16, 32, 64):
        row = decode_row(Dims(heads), 1, 1024, cache_dtype, device, 10, replace(base, num_splits=splits))
        row["part"] = "decode-sweep-b1"
        rows.append(row)
        _print_decode(row, f"sweep B=1 splits={splits}")


def _print_decode(row: dict[str, Any], label: str = "") -> None:
    config = row["config"]
    shape = (f"h{config['block_h']} n{config['decode_tile_n']} w{config['decode_num_warps']} "
             f"s{config['decode_num_stages']}{' keys_m' if config['decode_keys_m'] else ''} "
             f"splits={config['num_splits']}")
    print(f"decode heads={row['heads']:3d} B={row['B']:3d} ctx={row['context']:5d} {row['cache_dtype']:13s} "
          f"{'legacy' if row['legacy'] else 'new   '} {row['us']:8.1f} us  {row['cache_TBps']:5.2f} TB/s "
          f"({row['hbm_fraction']:.2f} of {PEAK_BYTES_PER_S / 1e12:.1f})  {row['TFLOPs']:6.1f} TFLOP/s "
          f"({row['flop_fraction']:.2f} of {PEAK_FLOPS / 1e12:.0f})  {shape} {label}", flush=True)


# ---------------------------------------------------------------------------------------------- prefill


def prefill_row(dims: Dims, query_len: int, context: int, device: str, iters: int,
                num_seqs: int = 1) -> dict[str, Any]:
    """num_seqs sequences, each a chunk of query_len queries after `context` cached tokens (one launch of each
    path for all of them, as a prefill step has it), both paths checked on the last sequence's last queries.
    Timed as device time with the host ahead (a prefill forward is not captured in a graph, and its launches run
    ahead of the device), with each path's host time beside it."""
    from pagoda.kernels import reference as ref
    from pagoda.kernels.mla import mla_attention, mla_expanded_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seq_len = context + query_len
    cache, tables = _paged_cache(dims, [seq_len] * num_seqs, dtype, device, None)
    cache.mul_(0.3)
    h = dims.num_heads
    w_kv_b = (torch.randn(h * (dims.nope + dims.v_dim), dims.lat, device=device) * dims.lat ** -0.5).to(dtype)
    w_uk = w_kv_b.view(h, dims.nope + dims.v_dim, dims.lat)[:, :dims.nope]  # [heads, Dn, R]
    w_uv = w_kv_b.view(h, dims.nope + dims.v_dim, dims.lat)[:, dims.nope:]  # [heads, Dv, R]
    num_tokens = num_seqs * query_len
    q = (torch.randn(num_tokens, h, dims.nope + dims.rope, device=device) * 0.3).to(dtype)  # [T, heads, Dn + P]
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)  # [S]
    qsl = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device=device)  # [S + 1]

    def absorbed() -> torch.Tensor:
        q_abs = torch.cat((torch.bmm(q[..., :dims.nope].transpose(0, 1), w_uk).transpose(0, 1),
                           q[..., dims.nope:]), dim=-1)  # [T, heads, R + P]
        out_lat = mla_attention(q_abs, cache, tables, seq_lens, qsl, query_len, seq_len, dims.scale, dims.lat)
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, Dv]

    out = torch.empty(num_tokens, h, dims.v_dim, dtype=dtype, device=device)

    def expanded() -> torch.Tensor:
        mla_expanded_attention(q, cache, tables, [seq_len] * num_seqs, [query_len] * num_seqs,
                               list(range(num_seqs)), w_kv_b, dims.nope, dims.v_dim, dims.scale, out,
                               max_rows=1 << 30)
        return out

    check = min(query_len, 64)  # the last sequence's last `check` queries against the reference
    expected = ref.mla_expanded_attention(q[-check:].float(), cache.float(), tables[-1:], [seq_len], [check],
                                          w_kv_b.float(), dims.nope, dims.v_dim, dims.scale)
    err = max(_check(absorbed()[-check:], expected, f"absorbed q={query_len} ctx={context}"),
              _check(expanded()[-check:], expected, f"expanded q={query_len} ctx={context}"))
    (absorbed_us, absorbed_host_us), (expanded_us, expanded_host_us) = (_device_time_us(absorbed, device, iters),
                                                                        _device_time_us(expanded, device, iters))
    return {"part": "prefill", "heads": h, "num_seqs": num_seqs, "query_len": query_len, "context": context,
            "absorbed_us": absorbed_us, "expanded_us": expanded_us, "absorbed_host_us": absorbed_host_us,
            "expanded_host_us": expanded_host_us, "expanded_faster": expanded_us < absorbed_us,
            "max_abs_err": err}


def _device_time_us(fn: Any, device: str, iters: int) -> tuple[float, float]:
    """(device time, host time) of one call in us; on CPU wall time for both."""
    if device != "cuda":
        us = _time_us(fn, device, iters)
        return us, us
    device_ms, host_ms = queued_time_ms(fn, iters)
    return device_ms * 1e3, host_ms * 1e3


# Prefill steps as the reference workload has them (256 prompts of 512 tokens, 16k tokens a step offline): several
# 512-query chunks in one launch of each path.
STEP_SEQS = (4, 16, 32)
STEP_QUERY_LEN = 512


def _print_prefill(row: dict[str, Any]) -> None:
    print(f"prefill heads={row['heads']:3d} seqs={row['num_seqs']:2d} ctx={row['context']:6d} "
          f"q={row['query_len']:5d}: absorbed {row['absorbed_us']:9.1f} us  expanded {row['expanded_us']:9.1f} us"
          f"  (host {row['absorbed_host_us']:.0f} / {row['expanded_host_us']:.0f} us)", flush=True)


def prefill_part(device: str, quick: bool, smoke: bool) -> list[dict[str, Any]]:
    """The crossover query length of one sequence at each context (device time), then whole prefill steps."""
    rows = []
    if smoke:
        grid = [(SMOKE_DIMS, (4, 24), (0, 30))]
        steps: list[tuple[Dims, int, int]] = [(SMOKE_DIMS, 2, 8)]
    else:
        query_lens = (16, 32, 64, 128, 256, 512, 1024, 2048)
        grid = [(Dims(h), query_lens, (0, 1024, 4096) if quick else (0, 1024, 4096, 16384)) for h in (16, 128)]
        steps = [(Dims(h), seqs, STEP_QUERY_LEN) for h in (16, 128) for seqs in STEP_SEQS]
    iters = 2 if smoke else (5 if quick else 15)
    for dims, query_lens, contexts in grid:
        for context in contexts:
            crossover = None
            for query_len in query_lens:
                row = prefill_row(dims, query_len, context, device, iters)
                rows.append(row)
                _print_prefill(row)
                if row["expanded_faster"] and crossover is None:
                    crossover = query_len
                elif not row["expanded_faster"]:
                    crossover = None  # the smallest query length from which on expanding stays faster
            print(f"CROSSOVER heads={dims.num_heads} ctx={context}: expanded faster from q_len {crossover}", flush=True)
            rows.append({"part": "crossover", "heads": dims.num_heads, "context": context, "min_query_len": crossover})
    for dims, seqs, query_len in steps:
        row = prefill_row(dims, query_len, 0, device, iters, num_seqs=seqs)
        rows.append(row)
        _print_prefill(row)
    return rows


# ---------------------------------------------------------------------------------------------- capacity


def capacity_part() -> list[dict[str, Any]]:
    """KV blocks (16 tokens) per GiB over all layers: the latent cache as the worker allocates it (the DeepSeek
    family's KvLayout) against the same model with per-head K (Dn + P) and V (Dv) for every query head (what MLA
    replaces), bf16 and fp8."""
    from pagoda.services.worker.models import deepseek
    from pagoda.shared.shapes import SHAPES

    rows = []
    for name in ("deepseek-v2-lite", "deepseek-v3-slice"):
        arch = SHAPES[name]
        mla = arch.mla
        assert mla is not None
        layers = 61 if name == "deepseek-v3-slice" else arch.num_layers  # the full V3's 61 layers
        for dtype_bytes, dtype in ((2, "bf16"), (1, "fp8")):
            latent = deepseek.kv_layout(arch, 1).bytes_per_token(layers, dtype_bytes)
            mha = layers * arch.num_heads * (mla.qk_head_dim + mla.v_head_dim) * dtype_bytes
            row = {"part": "capacity", "model": name, "layers": layers, "dtype": dtype,
                   "latent_bytes_per_token": latent, "mha_bytes_per_token": mha,
                   "blocks_per_GiB_latent": (1 << 30) // (16 * latent), "blocks_per_GiB_mha": (1 << 30) // (16 * mha),
                   "ratio": mha / latent}
            rows.append(row)
            print(f"capacity {name} ({layers} layers) {dtype}: {latent} B vs {mha} B per token -> "
                  f"{row['blocks_per_GiB_latent']} vs {row['blocks_per_GiB_mha']} blocks of 16 per GiB "
                  f"({row['ratio']:.2f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="decode,prefill,capacity")
    parser.add_argument("--sweep", action="store_true", help="decode launch-shape sweep")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, to check the script itself")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        parser.error("needs a CUDA device (or --smoke)")
    if device == "cpu":
        use_interpreter()
    torch.manual_seed(0)
    parts = set(args.parts.split(","))
    rows: list[dict[str, Any]] = []
    if device == "cuda":
        print(torch.cuda.get_device_name(), flush=True)
    if "decode" in parts:
        rows += decode_part(device, args.quick, args.sweep, args.smoke)
    elif args.sweep:  # the sweep alone
        rows += decode_part(device, args.quick, True, args.smoke, grid_rows=False)
    if "lazy" in parts:
        rows += lazy_part(device, args.smoke)
    if "prefill" in parts:
        rows += prefill_part(device, args.quick, args.smoke)
    if "capacity" in parts:
        rows += capacity_part()
    write_report(rows, args.out, "mla_bench.json", indent=1, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
