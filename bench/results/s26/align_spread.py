"""Twenty-sixth session probe: the prefill alignment, sort-based (align_pairs_sorted) against the multi-program
kernels (align_pairs_spread), at deepseek-v2-lite's (66 experts, 8 picks) and qwen3-30b-a3b's (128, 8) prefill
batches; each layout checked against the other's (same counts, runs and tiles; every pair once), then timed as 8
launches in one CUDA graph.

    python3 bench/results/s26/align_spread.py
"""

from __future__ import annotations

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import moe


def check(got: moe.Alignment, want: moe.Alignment, num_pairs: int) -> None:
    assert torch.equal(got.num_padded, want.num_padded) and torch.equal(got.tile_experts, want.tile_experts)
    assert torch.equal(got.run_ends, want.run_ends)
    used = int(got.num_padded)
    pairs = got.sorted_pairs[:used]
    real = pairs[pairs < num_pairs].sort().values
    assert torch.equal(real, torch.arange(num_pairs, dtype=torch.int32, device=real.device))
    tiles = got.tile_experts.repeat_interleave(got.block_m)[:used]  # [used]: each row's expert
    assert torch.equal(torch.sort(tiles[pairs < num_pairs]).values, torch.sort(want.tile_experts.repeat_interleave(
        want.block_m)[:used][want.sorted_pairs[:used] < num_pairs]).values)


def time_us(aligner, ids: torch.Tensor, experts: int, block_m: int) -> float:  # noqa: ANN001
    return 1000 * graph_time_ms([lambda: aligner(ids, experts, block_m)] * 8, reps=10)


def main() -> None:
    print("experts tokens block_m | sorted  spread (us a call)")
    for experts, shared in ((66, 2), (128, 0)):
        for tokens in (1024, 4096, 16384):
            ids = torch.randint(0, experts - shared, (tokens, 8), dtype=torch.int32, device="cuda")
            if shared:
                ids[:, 6:] = torch.arange(experts - shared, experts, dtype=torch.int32, device="cuda")
            for block_m in (1, 128):
                check(moe.align_pairs_spread(ids, experts, block_m), moe.align_pairs_sorted(ids, experts, block_m),
                      ids.numel())
                sort_us = time_us(moe.align_pairs_sorted, ids, experts, block_m)
                spread_us = time_us(moe.align_pairs_spread, ids, experts, block_m)
                print(f"{experts:7d} {tokens:6d} {block_m:7d} | {sort_us:7.1f} {spread_us:7.1f}", flush=True)


if __name__ == "__main__":
    main()
