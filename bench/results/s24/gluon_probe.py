"""Timing probes of kernels/fp8_decode_gluon.py (twenty-fourth session): one decode layer, B=256, contexts 512-768,
qwen3-0.6b / llama3-8b heads, graph-timed over >= 512 MB of KV a cycle as kv_fp8_bench does. An earlier version also ran
the copies and waits alone (DEBUG=2, since removed: the access pattern's ceiling, 3.8-4.2 TB/s); Triton's launch for
comparison."""
from __future__ import annotations

import sys
from functools import partial

import torch

from pagoda.bench import kv_fp8_bench as kb
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import fp8_decode_gluon as fg
from pagoda.kernels import paged_attention as pa


def launch(batch, copy: int, stages: int, out: torch.Tensor, packed: bool, max_regs: int = 0) -> None:
    k_cache, v_cache = batch.caches[True]
    k_scale, v_scale = batch.scales
    q = batch.q
    table = batch.copy_tables[copy]
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    fg.fp8_decode_kernel[(num_kv_heads, table.shape[0] + 1, 1)](
        out, q, k_cache, v_cache, table, batch.seq_lens, batch.query_start_loc, out, out, out, k_scale, v_scale,
        kb.HEAD_DIM ** -0.5 * 1.4426950408889634, table.shape[0], q.shape[0], q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0), NUM_HEADS=q.shape[1],
        GROUP=group, HEAD_DIM=kb.HEAD_DIM, BLOCK_SIZE=kb.BLOCK_SIZE, BLOCK_M=max(16, group), TILE_N=64, NUM_SPLITS=1,
        STAGES=stages, USE_PDL=0, PACKED=packed, num_warps=4,
        **({"maxnreg": max_regs} if max_regs else {}))


def main() -> int:
    torch.manual_seed(0)
    for model, (num_heads, num_kv_heads) in kb.MODELS.items():
        for num_seqs, (lo, hi) in ((256, (512, 768)), (64, (512, 768)), (256, (1024, 1024))):
            seq_lens = [lo + (b * (hi - lo)) // num_seqs for b in range(num_seqs)]
            batch = kb.make_batch(num_heads, num_kv_heads, [1] * num_seqs, seq_lens)
            kv_bytes = sum(seq_lens) * num_kv_heads * kb.HEAD_DIM * 2
            out = torch.empty_like(batch.q)
            rows = []
            default = kb.Variant("fp8_default", True, {"decode_pipelined": False})  # Triton's launch
            config = kb.variant_config(batch, default)
            calls = [partial(kb.run_variant, batch, default, config, c) for c in range(len(batch.copy_tables))]
            rows.append(("triton (qk_fp8x2)", 1e3 * graph_time_ms(calls, reps=10, replays=1)))
            expected = kb.run_variant(batch, default, config, 0).float()
            for name, stages, packed, max_regs in (
                    ("gluon s2", 2, False, 0), ("gluon s2 packed", 2, True, 0), ("gluon s3 packed", 3, True, 0),
                    ("gluon s2 packed, 64 regs", 2, True, 64)):
                launch(batch, 0, stages, out, packed, max_regs)
                error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
                calls = [partial(launch, batch, c, stages, out, packed, max_regs)
                         for c in range(len(batch.copy_tables))]
                rows.append((f"{name} (vs default {error:.1e})", 1e3 * graph_time_ms(calls, reps=10, replays=1)))
            print(f"-- {model} B={num_seqs} ctx {lo}-{hi}")
            for name, us in rows:
                print(f"   {name:40s} {us:8.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s")
            del batch
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
