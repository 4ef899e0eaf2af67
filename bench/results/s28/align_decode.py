"""Twenty-eighth session probe: the decode-size MoE alignment, the one-program kernel (serial relaxed atomics,
kernels/moe.align_pairs_triton) against a program per expert (kernels/moe.align_pairs_by_expert, no atomics),
each timed as 32 launches in one CUDA graph, every layout checked against the stable sort first. Shapes:
deepseek-v2-lite (66 experts incl. 2 shared, 8 picks), qwen3-30b-a3b (128, 8), mixtral-8x7b (8, 2); block_m as
their tuned tables pick it at each batch.

    python3 bench/results/s28/align_decode.py
"""

from __future__ import annotations

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import moe

CALLS = 32


def ids_for(num_tokens: int, experts: int, top_k: int, shared: int) -> torch.Tensor:
    routed = experts - shared
    scores = torch.rand(num_tokens, routed, device="cuda")
    ids = scores.topk(top_k - shared, dim=1).indices.to(torch.int32)
    if shared:
        extra = torch.arange(routed, experts, dtype=torch.int32, device="cuda").expand(num_tokens, shared)
        ids = torch.cat([ids, extra], dim=1)
    return ids.contiguous()


def time_us(aligner, ids: torch.Tensor, experts: int, block_m: int) -> float:  # noqa: ANN001
    got, want = aligner(ids, experts, block_m), moe.align_pairs_sorted(ids, experts, block_m)
    assert torch.equal(got.num_padded, want.num_padded) and torch.equal(got.tile_experts, want.tile_experts)
    assert torch.equal(got.run_ends, want.run_ends)
    return 1000 * graph_time_ms([lambda: aligner(ids, experts, block_m)] * CALLS, reps=20)


def main() -> None:
    print("shape tokens block_m | one program | by expert: w4/c1024  w8/c1024  w4/c512  w4/c2048 (us a call)")
    for name, experts, top_k, shared in (("v2-lite", 66, 8, 2), ("qwen3-30b", 128, 8, 0), ("mixtral", 8, 2, 0)):
        for tokens in (1, 16, 64, 128, 256, 512):
            block_m = 16 if tokens <= 64 else (32 if tokens <= 128 else 64)
            ids = ids_for(tokens, experts, top_k, shared)
            old = time_us(moe.align_pairs_triton, ids, experts, block_m)
            cells = []
            for warps, chunk in ((4, 1024), (8, 1024), (4, 512), (4, 2048)):
                moe.ALIGN_BY_EXPERT_WARPS, moe.ALIGN_BY_EXPERT_CHUNK = warps, chunk
                cells.append(f"{time_us(moe.align_pairs_by_expert, ids, experts, block_m):8.2f}")
            moe.ALIGN_BY_EXPERT_WARPS, moe.ALIGN_BY_EXPERT_CHUNK = 4, 1024
            print(f"{name:>9} {tokens:6d} {block_m:7d} | {old:11.2f} | " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
