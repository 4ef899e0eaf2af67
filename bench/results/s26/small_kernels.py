"""Twenty-sixth session probe: launch parameters of two latency-bound kernels, each timed as 32 launches in one
CUDA graph (call 3's timings, one launch a graph, were mostly the graph launch's own cost and are not kept).

    python3 bench/results/s26/small_kernels.py

- the one-program MoE alignment (kernels/moe._align_kernel) at deepseek-v2-lite's decode batches (66 experts with
  the shared ones, 8 picks a token, the tuned tables' block_m), by num_warps and CHUNK;
- the residual add + RMSNorm over split-K partial sums (kernels/norm._rms_norm_kernel, X_PARTS) at llama3-8b's
  batch-1 shapes, by num_warps.
"""

from __future__ import annotations

import torch
import triton

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import moe, norm

CALLS = 32  # launches back to back in one graph, the time divided by them: a lone replay is mostly launch cost


def align(num_tokens: int, block_m: int, num_warps: int, chunk: int) -> float:
    experts, top_k = 66, 8
    ids = torch.randint(0, 64, (num_tokens, top_k), dtype=torch.int32, device="cuda")
    ids[:, 6:] = torch.tensor([64, 65], dtype=torch.int32, device="cuda")
    num_pairs = ids.numel()
    max_padded = moe.max_padded_rows(num_pairs, experts, block_m)
    max_tiles = -(-max_padded // block_m)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device="cuda")
    tile_experts = torch.empty(max_tiles, dtype=torch.int32, device="cuda")
    num_padded = torch.empty(1, dtype=torch.int32, device="cuda")
    cursors = torch.empty(experts, dtype=torch.int32, device="cuda")
    experts_p = triton.next_power_of_2(experts)

    def run() -> None:
        moe._align_kernel[(1,)](ids, sorted_pairs, tile_experts, num_padded, cursors, num_pairs, max_padded,
                                max_tiles, NUM_EXPERTS=experts, EXPERTS_P=experts_p, BLOCK_M=block_m, CHUNK=chunk,
                                TILE_CHUNK=max(16, 4096 // experts_p), num_warps=num_warps)

    run()
    reference = moe.align_pairs_sorted(ids, experts, block_m)
    assert torch.equal(num_padded, reference.num_padded) and torch.equal(tile_experts, reference.tile_experts)
    return 1000 * graph_time_ms([run] * CALLS, reps=20)


def rms_parts(num_parts: int, num_warps: int, hidden: int = 4096) -> float:
    parts = torch.randn(num_parts, 1, hidden, device="cuda")  # fp32 partial sums [S, T, H]
    residual = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16)
    summed = torch.empty_like(out)

    def run() -> None:
        norm._rms_norm_kernel[(1,)](parts, residual, weight, out, summed, 1, 1, hidden, 1e-5,
                                    parts.stride(1), 0, residual.stride(0), 0, out.stride(0), 0, summed.stride(0), 0,
                                    parts.stride(0), HAS_RESIDUAL=True, X_PARTS=num_parts, BLOCK_R=1,
                                    BLOCK_N=triton.next_power_of_2(hidden), USE_PDL=False, num_warps=num_warps)

    run()
    return 1000 * graph_time_ms([run] * CALLS, reps=20)


def main() -> None:
    print("align (us): tokens block_m | num_warps x CHUNK")
    for tokens, block_m in ((1, 16), (64, 16), (128, 32), (256, 64)):
        cells = [f"w{w}/c{c} {align(tokens, block_m, w, c):.2f}" for w in (4, 8, 16) for c in (256, 1024, 2048)]
        print(f"  T={tokens:4d} bm={block_m:3d} | " + "  ".join(cells), flush=True)
    print("add + RMSNorm over split-K parts, one row of 4096 (us): parts | num_warps")
    for num_parts in (0, 1, 2, 4, 8):
        if num_parts == 0:
            continue
        cells = [f"w{w} {rms_parts(num_parts, w):.2f}" for w in (4, 8, 16, 32)]
        print(f"  parts={num_parts} | " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
