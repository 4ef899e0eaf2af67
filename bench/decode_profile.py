"""Where one decode step's GPU time goes, and which attention launch shape is fastest for it (CUDA only).

`python -m pagoda.bench.decode_profile --model qwen3-0.6b [--batch 256] [--ctx-lo 512 --ctx-hi 768] [--sweep]`

Builds the model with dummy weights, a decode batch of `--batch` sequences whose contexts are spread evenly over
[ctx-lo, ctx-hi) (the middle of the reference run: 512-token prompts, 256 output tokens), then prints
- the whole step (forward, LM head, greedy argmax) replayed in a CUDA graph, per attention launch shape;
- a per-kernel breakdown of one eager step (torch.profiler), grouped by kernel name;
- with --sweep: the attention kernel alone over launch shapes, against the KV bytes it must read;
- a prefill step of `--prefill-seqs` x `--prefill-len` tokens (time and breakdown).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from dataclasses import asdict, replace

import torch

from pagoda.bench.report import write_json
from pagoda.kernels import paged_attention as pa
from pagoda.services.worker.models import AttentionMetadata, CausalLM
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

PEAK_BYTES_PER_S = 4.2e12
BLOCK_SIZE = 16


def make_batch(query_lens: list[int], seq_lens: list[int],
               device: torch.device) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Metadata for sequences laid out in consecutive blocks; returns (meta, positions [T], blocks needed)."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)  # [B, max_blocks]
    slots: list[int] = []
    positions: list[int] = []
    start = 0
    for b, (q_len, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        block_tables[b, :blocks_per_seq[b]] = torch.arange(start, start + blocks_per_seq[b])
        for pos in range(n - q_len, n):
            slots.append(start * BLOCK_SIZE + pos)
            positions.append(pos)
        start += blocks_per_seq[b]
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens_host=list(seq_lens), query_lens_host=list(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return meta, torch.tensor(positions, dtype=torch.int64, device=device), start


def step_fn(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, caches: list, meta: AttentionMetadata):
    def run() -> torch.Tensor:
        hidden = model(ids, positions, caches, meta)  # [T, H]
        last = hidden[meta.query_start_loc[1:] - 1]  # [B, H]
        return model.compute_logits(last).argmax(-1)  # [B]
    return run


def graph_ms(fn, reps: int = 20) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median")


def kernel_breakdown(fn, steps: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, GPU us per step, launches per step), largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:70]
            total[name] += event.device_time
            count[name] += 1
    rows = [(name, us / steps, count[name] // steps) for name, us in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def print_breakdown(title: str, rows: list[tuple[str, float, int]], top: int = 18) -> None:
    whole = sum(r[1] for r in rows)
    print(f"-- {title}: {whole / 1e3:.3f} ms of kernels per step, {sum(r[2] for r in rows)} launches")
    for name, us, n in rows[:top]:
        print(f"   {us:9.1f} us {100 * us / whole:5.1f}%  x{n:<4d} {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ctx-lo", type=int, default=512)
    parser.add_argument("--ctx-hi", type=int, default=768)
    parser.add_argument("--prefill-seqs", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_profile needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    arch = SHAPES[args.model]
    model = CausalLM(arch, torch.bfloat16, device, max_positions=max(args.ctx_hi, args.prefill_len) + 16)
    load_model(model, None, "dummy", seed=0)
    batch = args.batch
    seq_lens = [args.ctx_lo + (b * (args.ctx_hi - args.ctx_lo)) // batch for b in range(batch)]
    meta, positions, num_blocks = make_batch([1] * batch, seq_lens, device)
    cache_shape = (max(num_blocks, 1), BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.randn(cache_shape, dtype=torch.bfloat16, device=device),
               torch.randn(cache_shape, dtype=torch.bfloat16, device=device)) for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (batch,), device=device)
    kv_bytes = sum(seq_lens) * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2 * 2
    results: dict = {"model": args.model, "batch": batch, "ctx": [args.ctx_lo, args.ctx_hi],
                     "kv_gb_per_step": kv_bytes / 1e9, "kv_floor_ms": kv_bytes / PEAK_BYTES_PER_S * 1e3}
    print(f"{args.model} decode B={batch} ctx {args.ctx_lo}-{args.ctx_hi}: KV {kv_bytes / 1e9:.2f} GB per step "
          f"(floor {results['kv_floor_ms']:.2f} ms at 4.2 TB/s)")
    step = step_fn(model, ids, positions, caches, meta)
    default = pa.pick_config(batch, batch, arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, 1,
                             max(seq_lens), torch.cuda.get_device_properties(0).multi_processor_count)
    original_pick = pa.pick_config

    def with_config(config: pa.AttentionConfig) -> float:
        pa.pick_config = lambda *a, **k: config  # type: ignore[assignment]
        try:
            return graph_ms(step)
        finally:
            pa.pick_config = original_pick

    step_rows = []
    for name, config in (("default", default), ("heads_fast", replace(default, heads_fast=True))):
        ms = with_config(config)
        step_rows.append({"config": name, "step_ms": ms})
        print(f"step (CUDA graph), attention {name}: {ms:.3f} ms")
    results["step"] = step_rows
    rows = kernel_breakdown(step)
    print_breakdown("decode step, eager", rows)
    results["decode_kernels"] = rows

    q = torch.randn(batch, arch.num_heads, arch.head_dim, dtype=torch.bfloat16, device=device)
    k_cache, v_cache = caches[0]
    layer_bytes = kv_bytes / arch.num_layers

    def attention(config: pa.AttentionConfig):
        return lambda: pa.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, 1, max(seq_lens), 0.088, config=config)

    if args.sweep:
        sweep_rows = []
        grid = itertools.product((32, 64, 128), (2, 4, 8), (2, 3), (False, True), (1,))
        for tile, warps, stages, fast, splits in grid:
            config = pa.AttentionConfig(num_splits=splits, decode_tile_n=tile, decode_num_warps=warps,
                                        decode_num_stages=stages, heads_fast=fast)
            try:
                us = graph_ms(attention(config), reps=10) * 1e3
            except Exception as exc:  # noqa: BLE001 - a shape the compiler refuses (shared memory) is skipped
                print(f"   skip {config}: {type(exc).__name__}")
                continue
            sweep_rows.append({**asdict(config), "us": us, "tb_per_s": layer_bytes / us / 1e6})
        sweep_rows.sort(key=lambda r: r["us"])
        base = graph_ms(attention(default), reps=10) * 1e3
        print(f"-- attention sweep, one layer: default {base:.1f} us ({layer_bytes / base / 1e6:.2f} TB/s)")
        for row in sweep_rows[:12]:
            print(f"   {row['us']:7.1f} us {row['tb_per_s']:.2f} TB/s  tile {row['decode_tile_n']} warps "
                  f"{row['decode_num_warps']} stages {row['decode_num_stages']} heads_fast {row['heads_fast']} "
                  f"splits {row['num_splits']}")
        results["attention_sweep"] = sweep_rows
        results["attention_default_us"] = base

    pre_lens = [args.prefill_len] * args.prefill_seqs
    pmeta, ppos, pblocks = make_batch(pre_lens, pre_lens, device)
    pcaches = [(torch.zeros((pblocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim), dtype=torch.bfloat16,
                            device=device),) * 2 for _ in range(arch.num_layers)]
    pids = torch.randint(0, arch.vocab_size, (sum(pre_lens),), device=device)
    prefill = step_fn(model, pids, ppos, pcaches, pmeta)
    import triton.testing
    pms = triton.testing.do_bench(prefill, rep=50, return_mode="median")
    tokens = sum(pre_lens)
    flops = 2 * tokens * (arch.num_params() - arch.vocab_size * arch.hidden_size)
    print(f"prefill {args.prefill_seqs} x {args.prefill_len}: {pms:.2f} ms ({flops / pms / 1e9:.0f} TFLOP/s on "
          f"the linear layers)")
    results["prefill_ms"] = pms
    prow = kernel_breakdown(prefill)
    print_breakdown("prefill step, eager", prow)
    results["prefill_kernels"] = prow
    if args.out:
        write_json(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
