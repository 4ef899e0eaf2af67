"""bench/moe_tune.py's host-side pieces: how many weight copies a small batch is tuned over (so no launch finds its
experts in L2), and the table merge that keeps a committed table's other buckets."""

from __future__ import annotations

import pytest

from pagoda.bench import moe_tune
from pagoda.kernels import moe

H200_L2 = 50 * 1024 * 1024
V2_LITE_DOWN = 2048 * 1408 * 2  # one expert's down projection, bf16


def test_small_batches_cycle_enough_copies_to_miss_l2() -> None:
    one_token = moe_tune.copies_for(1, 8, 66, V2_LITE_DOWN, H200_L2)  # 8 experts: 46 MB a down launch
    assert one_token * 8 * V2_LITE_DOWN >= 4 * H200_L2
    assert (one_token - 1) * 8 * V2_LITE_DOWN < 4 * H200_L2  # no more copies than that
    assert moe_tune.copies_for(256, 8, 66, V2_LITE_DOWN, H200_L2) == 1  # all 66 experts: 380 MB already
    assert moe_tune.copies_for(1, 8, 128, 1024, H200_L2) == moe_tune.MAX_COPIES  # capped


def test_merge_keeps_other_buckets_and_orders_them() -> None:
    committed = {"1": {"old": 1}, "4": {"old": 4}, "16": {"old": 16}}
    merged = moe_tune.merge_table(committed, {2: {"new": 2}, 4: {"new": 4}})
    assert list(merged) == ["1", "2", "4", "16"]
    assert merged["1"] == {"old": 1} and merged["2"] == {"new": 2} and merged["4"] == {"new": 4}


@pytest.mark.parametrize("candidate", moe_tune.GEMV_CANDIDATES + moe_tune.DOWN_GEMV_CANDIDATES)
def test_gemv_candidates_are_power_of_two_tiles(candidate: tuple) -> None:
    tile = moe.GemvConfig(*candidate)
    for size in (tile.block_n, tile.block_k, tile.num_warps):
        assert size & (size - 1) == 0, tile
