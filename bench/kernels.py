"""Kernel micro-benchmarks on one CUDA device: `python -m pagoda.bench.kernels [--sweep] [--quick]`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = 4.2e12  # measured HBM copy bandwidth of an H200 (DESIGN.md)
PEAK_FLOPS = 780e12  # measured dense bf16 matmul rate of an H200
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
HEAD_DIM = 128
MODELS = {"qwen3-0.6b": (16, 8, 1024, 3072), "llama3-8b": (32, 8, 4096, 14336)}  # heads, kv heads, hidden, mlp


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    us: float  # median GPU time per call, cold L2 (triton do_bench)
    graph_us: float  # median per call replayed in a CUDA graph: no launch overhead, but L2 stays warm
    host_us: float  # wall time per call of back-to-back eager calls: >= us when Python launch overhead dominates
    bytes_moved: float
    flops: float = 0.0
    baseline: str = ""
    baseline_us: float = 0.0


def bench(fn: Callable[[], object], quick: bool, graph: bool = True) -> tuple[float, float, float]:
    """(median GPU us with L2 flushed between calls, median us in a CUDA graph (nan if not graph), eager wall us
    per call)."""
    import triton.testing

    gpu_ms = triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
    graph_ms = float("nan")
    if graph:
        graph_ms = triton.testing.do_bench_cudagraph(fn, rep=10 if quick else 30, return_mode="median")
    calls = 20 if quick else 100
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return gpu_ms * 1e3, graph_ms * 1e3, (time.perf_counter() - start) / calls * 1e6


def measure(kernel: str, shape: str, fn: Callable[[], object], baseline: str, baseline_fn: Callable[[], object],
            bytes_moved: float, flops: float, quick: bool) -> Row:
    us, graph_us, host_us = bench(fn, quick)
    baseline_us = bench(baseline_fn, quick, graph=False)[0]  # the references sync with the host: no graphs
    return Row(kernel, shape, us, graph_us, host_us, bytes_moved, flops, baseline, baseline_us)


def paged_batch(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int) -> dict:
    """Random q and caches with each sequence's blocks scattered through a shuffled pool."""
    device = "cuda"
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    max_blocks = max(blocks_per_seq)
    pool = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)  # [B, max_blocks]
    start = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = pool[start:start + n]
        start += n
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return dict(
        q=torch.randn(starts[-1], num_heads, HEAD_DIM, device=device, dtype=DTYPE),  # [T, heads, D]
        k_cache=torch.randn(cache_shape, device=device, dtype=DTYPE),  # [N, bs, kvh, D]
        v_cache=torch.randn(cache_shape, device=device, dtype=DTYPE),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),  # [B]
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),  # [B + 1]
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), scale=HEAD_DIM ** -0.5)


def attention_cost(query_lens: list[int], seq_lens: list[int], num_heads: int,
                   num_kv_heads: int) -> tuple[float, float]:
    """(bytes: K/V read once per kv head + q + out, FLOPs: 2 matmuls over the causal (query, key) pairs)."""
    kv_bytes = sum(seq_lens) * num_kv_heads * HEAD_DIM * 2 * 2
    q_bytes = sum(query_lens) * num_heads * HEAD_DIM * 2 * 2
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))
    return kv_bytes + q_bytes, 4.0 * pairs * num_heads * HEAD_DIM


def attention_rows(quick: bool) -> list[Row]:
    from pagoda.kernels import reference as ref
    from pagoda.kernels.paged_attention import paged_attention

    rows = []
    sdpa = F.scaled_dot_product_attention
    for model, (num_heads, num_kv_heads, _, _) in MODELS.items():
        for batch_size in (1, 32, 256):
            for context in (512, 2048):
                query_lens, seq_lens = [1] * batch_size, [context] * batch_size
                args = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads)
                # baseline: SDPA over contiguous (unpaged) K/V, the best a gather-free layout gets from torch
                q = args["q"].view(batch_size, 1, num_heads, HEAD_DIM).transpose(1, 2)  # [B, heads, 1, D]
                k = torch.randn(batch_size, num_kv_heads, context, HEAD_DIM, device="cuda", dtype=DTYPE)
                v = torch.randn_like(k)  # [B, kv_heads, ctx, D]
                rows.append(measure("paged_attention decode", f"{model} B={batch_size} ctx={context}",
                                    partial(paged_attention, **args), "sdpa contiguous",
                                    partial(sdpa, q, k, v, enable_gqa=True),
                                    *attention_cost(query_lens, seq_lens, num_heads, num_kv_heads), quick))
                del args, q, k, v
        # mixed step: 4 prefill chunks of 512 (two over cached prefixes) + 124 decodes at 1024
        query_lens = [512] * 4 + [1] * 124
        seq_lens = [512, 512, 1536, 2560] + [1024] * 124
        args = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads)
        reference = partial(ref.paged_attention, args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                            seq_lens, query_lens, args["scale"])
        rows.append(measure("paged_attention mixed", f"{model} 4x512 chunks + 124 decodes",
                            partial(paged_attention, **args), "reference (gather+sdpa)", reference,
                            *attention_cost(query_lens, seq_lens, num_heads, num_kv_heads), quick))
        # pure prefill: 8 prompts of 512, vs SDPA causal (flash) on the dense batch
        query_lens = seq_lens = [512] * 8
        args = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads)
        q = args["q"].view(8, 512, num_heads, HEAD_DIM).transpose(1, 2)  # [8, heads, 512, D]
        k = torch.randn(8, num_kv_heads, 512, HEAD_DIM, device="cuda", dtype=DTYPE)  # [8, kv_heads, 512, D]
        v = torch.randn_like(k)
        rows.append(measure("paged_attention prefill", f"{model} 8x512", partial(paged_attention, **args),
                            "sdpa causal dense", partial(sdpa, q, k, v, is_causal=True, enable_gqa=True),
                            *attention_cost(query_lens, seq_lens, num_heads, num_kv_heads), quick))
    return rows


def elementwise_rows(quick: bool) -> list[Row]:
    from pagoda.kernels import reference as ref
    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.kv_cache import write_kv
    from pagoda.kernels.norm import add_rms_norm, rms_norm
    from pagoda.kernels.rope import apply_rope

    rows = []
    dev, size = "cuda", 2  # bf16 bytes
    for model, (num_heads, num_kv_heads, hidden, mlp) in MODELS.items():
        for num_tokens in (256, 8192):
            tag = f"{model} T={num_tokens}"
            k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, device=dev, dtype=DTYPE)  # [T, kvh, D]
            v = torch.randn_like(k)
            num_blocks = num_tokens // BLOCK_SIZE * 2
            k_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=dev, dtype=DTYPE)
            v_cache = torch.zeros_like(k_cache)  # [N, bs, kvh, D]
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:num_tokens]  # [T]
            kv_args = (k, v, k_cache, v_cache, slots)
            rows.append(measure("write_kv", tag, partial(write_kv, *kv_args), "reference",
                                partial(ref.write_kv, *kv_args), 4 * k.numel() * size, 0, quick))

            x = torch.randn(num_tokens, hidden, device=dev, dtype=DTYPE)  # [T, H]
            residual = torch.randn_like(x)
            weight = torch.randn(hidden, device=dev, dtype=DTYPE)  # [H]
            rows.append(measure("rms_norm", tag, partial(rms_norm, x, weight, 1e-6), "reference",
                                partial(ref.rms_norm, x, weight, 1e-6), 2 * x.numel() * size, 0, quick))
            rows.append(measure("add_rms_norm", tag, partial(add_rms_norm, x, residual, weight, 1e-6), "reference",
                                partial(ref.add_rms_norm, x, residual, weight, 1e-6), 4 * x.numel() * size, 0,
                                quick))

            qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM, device=dev, dtype=DTYPE)
            q = qkv[:, :num_heads * HEAD_DIM].view(num_tokens, num_heads, HEAD_DIM)  # [T, heads, D] strided
            k_rows = qkv[:, num_heads * HEAD_DIM:(num_heads + num_kv_heads) * HEAD_DIM]
            k = k_rows.view(num_tokens, num_kv_heads, HEAD_DIM)  # [T, kv_heads, D] strided
            positions = torch.randint(0, 4096, (num_tokens,), device=dev)  # [T]
            inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
            cos, sin = ref.rope_cos_sin(inv_freq, positions, DTYPE)  # [T, D]
            rope_bytes = 2 * (q.numel() + k.numel()) * size + 2 * cos.numel() * size
            rows.append(measure("apply_rope (in place)", tag, partial(apply_rope, q, k, cos, sin, inplace=True),
                                "reference", partial(_reference_rope, q, k, cos, sin), rope_bytes, 0, quick))

            gate_up = torch.randn(num_tokens, 2 * mlp, device=dev, dtype=DTYPE)  # [T, 2I]
            rows.append(measure("silu_and_mul", tag, partial(silu_and_mul, gate_up), "reference",
                                partial(ref.silu_and_mul, gate_up), 1.5 * gate_up.numel() * size, 0, quick))
    return rows


def _reference_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pagoda.kernels import reference as ref

    return ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)


def sweep(quick: bool) -> None:
    """Try launch shapes of the attention kernel on llama3-8b shapes; prints the best few per workload."""
    import triton.testing

    from pagoda.kernels.paged_attention import AttentionConfig, paged_attention, pick_config

    num_heads, num_kv_heads = MODELS["llama3-8b"][:2]
    workloads = {
        "decode B=32 ctx=2048": ([1] * 32, [2048] * 32),
        "decode B=256 ctx=2048": ([1] * 256, [2048] * 256),
        "decode B=1 ctx=512": ([1], [512]),
        "decode B=1 ctx=2048": ([1], [2048]),
        "decode B=1 ctx=8192": ([1], [8192]),
        "decode B=8 ctx=2048": ([1] * 8, [2048] * 8),
        "decode B=4 ctx=4096": ([1] * 4, [4096] * 4),
        "prefill 8x512": ([512] * 8, [512] * 8),
        "mixed 4x512 + 124 decodes": ([512] * 4 + [1] * 124, [512, 512, 1536, 2560] + [1024] * 124),
    }
    for name, (query_lens, seq_lens) in workloads.items():
        args = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads)
        if max(query_lens) == 1 and len(query_lens) < 32:  # few long sequences: how many KV splits
            configs = [AttentionConfig(num_splits=s) for s in (1, 2, 4, 8, 16)]
        elif max(query_lens) == 1:
            configs = [AttentionConfig(decode_tile_n=t, decode_num_warps=w, decode_num_stages=st)
                       for t in (16, 32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3)]
        else:
            configs = [AttentionConfig(prefill_block_m=m, prefill_tile_n=t, prefill_num_warps=w,
                                       prefill_num_stages=st)
                       for m in (64, 128) for t in (32, 64, 128) for w in (4, 8) for st in (1, 2, 3)]
        default = pick_config(sum(query_lens), len(query_lens), num_kv_heads, num_heads // num_kv_heads,
                              max(query_lens), max(seq_lens))
        configs.append(default)
        results = []
        for config in configs:
            try:
                # in a CUDA graph, as decode runs in the worker: no Python launch overhead in the number
                ms = triton.testing.do_bench_cudagraph(partial(paged_attention, **args, config=config),
                                                       rep=10 if quick else 30, return_mode="median")
            except Exception as exc:  # out of shared memory / registers for this shape: skip it
                print(f"  {config}: failed ({type(exc).__name__})")
                continue
            results.append((ms * 1e3, config))
        results.sort(key=lambda r: r[0])
        print(f"\n{name}: best of {len(results)}")
        for us, config in results[:4]:
            print(f"  {us:9.1f} us  {config}")
        rank, default_us = next((i, us) for i, (us, config) in enumerate(results) if config is default)
        print(f"  default: {default_us:.1f} us (rank {rank + 1}) {default}")
        del args


def print_table(rows: list[Row]) -> None:
    header = (f"{'kernel':<24} {'shape':<36} {'us':>8} {'graph_us':>8} {'host_us':>8} {'GB/s':>6} {'%bw':>5} "
              f"{'TFLOP/s':>7} "
              f"{'baseline':<24} {'base_us':>9} {'speedup':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        gbs = r.bytes_moved / (r.us * 1e-6) / 1e9
        tflops = r.flops / (r.us * 1e-6) / 1e12
        print(f"{r.kernel:<24} {r.shape:<36} {r.us:8.1f} {r.graph_us:8.1f} {r.host_us:8.1f} {gbs:6.0f} "
              f"{100 * gbs * 1e9 / PEAK_BYTES_PER_S:5.1f} {tflops:7.1f} {r.baseline:<24} {r.baseline_us:9.1f} "
              f"{r.baseline_us / r.us:7.2f}")
    print(f"\n%bw is against {PEAK_BYTES_PER_S / 1e12:.1f} TB/s; prefill TFLOP/s against ~{PEAK_FLOPS / 1e12:.0f}. "
          "us = median GPU time with L2 flushed (GB/s, TFLOP/s, speedup use it); graph_us = in a CUDA graph, L2 warm; "
          "host_us = eager wall time per call (Python launch overhead).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep attention launch shapes")
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--only", choices=["attention", "elementwise"], help="run one group of benchmarks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {DTYPE}")
    rows: list[Row] = []
    if args.only in (None, "attention"):
        rows += attention_rows(args.quick)
    if args.only in (None, "elementwise"):
        rows += elementwise_rows(args.quick)
    print_table(rows)
    if args.sweep:
        sweep(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
