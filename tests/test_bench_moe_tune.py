"""bench/moe_tune.py's host-side pieces: how many weight copies a small batch is tuned over (so no launch finds its
experts in L2), and the table merge that keeps a committed table's other buckets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

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


@pytest.mark.parametrize("group_k", [None, 128])
def test_fp8_candidates_time_both_forms_inside_scale_groups(group_k: int | None) -> None:
    """FP8 experts: every grouped-GEMM candidate weight-only and W8A8, each K block inside one scale group (as
    fused_experts fits it, so the tile timed is the tile served), none twice; bf16: the candidates as listed."""
    assert moe_tune.gemm_candidates(False, None, 2048) == [moe.TileConfig(*c) for c in moe_tune.CANDIDATES]
    tiles = moe_tune.gemm_candidates(True, group_k, 1408)
    assert len(tiles) == len(set(tiles))
    weight_only = {replace(t, act_fp8=False) for t in tiles if t.act_fp8}
    assert weight_only == {t for t in tiles if not t.act_fp8}
    if group_k:  # the 256-wide K blocks became 128-wide ones, some of them already among the candidates
        assert all(group_k % t.block_k == 0 for t in tiles) and len(tiles) < 2 * len(moe_tune.CANDIDATES)
    else:  # one scale a row: any K block (a ragged last one is masked)
        assert len(tiles) == 2 * len(moe_tune.CANDIDATES)


@pytest.mark.parametrize("group_k", [None, 32])
def test_quantize_experts_per_row_or_block(group_k: int | None) -> None:
    w = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))  # [E, N, K]
    q, scale = moe_tune.quantize_experts(w, group_k)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (3, 8, 64 // (group_k or 64))
    groups = scale.repeat_interleave(group_k or 64, dim=2)  # [E, N, K]
    # e4m3 rounds a normal value to 3 mantissa bits (half a step: 2^-4 of it) and a subnormal one (below 2^-6 once
    # scaled) to a fixed step of 2^-9: a value near zero has an absolute error of half that step, times its scale
    bound = w.abs() * 2.0 ** -4 + groups * 2.0 ** -10
    assert ((q.float() * groups - w).abs() <= bound * (1 + 1e-6)).all()


def test_gemv_candidates_fit_scale_blocks() -> None:
    assert moe_tune.gemv_candidates(None, 2048, True) == [moe.GemvConfig(*c) for c in moe_tune.GEMV_CANDIDATES]
    down = moe_tune.gemv_candidates(128, 1408, False)
    assert all(128 % t.block_k == 0 for t in down) and len(down) == len(set(down))
    assert any(t.pairs_at_once for t in down)  # the down GEMV's own candidates are kept


def test_gemm_runner_launches_what_the_tile_says() -> None:
    """The tuner's grouped-GEMM runner on FP8 experts (CPU, interpreter): the weight-only tile gives each pair's
    silu(gate) * up on the dequantized weights, its W8A8 twin the same to e4m3's precision but not bit for bit: the
    form timed is the form the table will serve."""
    gen = torch.Generator().manual_seed(0)
    num_experts, top_k, hidden, inter, tokens = 4, 2, 64, 32, 8
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5  # [E, 2I, H]
    q, scale = moe_tune.quantize_experts(w_gate_up)
    x = torch.randn(tokens, hidden, generator=gen)  # [T, H]
    weights, ids = moe.route_softmax_topk(torch.randn(tokens, num_experts, generator=gen), top_k, renormalize=True)
    dequantized = (q.float() * scale)[ids.long().view(-1)]  # [T * k, 2I, H]
    gate_up = torch.einsum("ph,pnh->pn", x.repeat_interleave(top_k, 0), dequantized)  # [T * k, 2I]
    expected = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [T * k, I]
    got = {}
    for act_fp8 in (False, True):
        tile = moe.TileConfig(16, 32, 32, 1, 4, 2, act_fp8=act_fp8)
        (run,) = moe_tune._gemm_runner(x, [(q, scale)], [(weights, ids)], True, tile, num_experts)
        got[act_fp8] = run().clone()
    torch.testing.assert_close(got[False], expected, atol=1e-5, rtol=1e-4)
    assert not torch.equal(got[True], got[False])
    torch.testing.assert_close(got[True], expected, atol=0.1 * expected.abs().max().item(), rtol=0)


class _Properties:
    L2_cache_size = 1 << 20


def test_fp8_tuning_runs_end_to_end_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """tune_shape and _measure on a tiny MoE shape with FP8 experts (interpreter; two grouped-GEMM tiles, one GEMV
    tile each; a timer that makes the last candidate timed the fastest): every path the GPU run takes, so a
    mistake in it costs no device time. The table names the FP8 file and keeps the W8A8 choice."""
    monkeypatch.setattr(moe_tune, "CANDIDATES", [(16, 32, 32, 1, 4, 2), (16, 32, 16, 1, 4, 2)])
    monkeypatch.setattr(moe_tune, "GEMV_CANDIDATES", [(16, 32, 4, 2)])
    monkeypatch.setattr(moe_tune, "DOWN_GEMV_CANDIDATES", [(16, 32, 4, 2, True)])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Properties())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    timings = iter(range(10_000, 0, -1))

    def timer(calls: object, reps: int = 10) -> float:
        for call in calls if isinstance(calls, list) else [calls]:
            call()
        return next(timings) / 1000
    monkeypatch.setattr(moe_tune, "graph_time_ms", timer)
    # 40 tokens: 80 pairs, past GEMV_MAX_PAIRS (grouped GEMMs only) as 64 was, with the same weight copies
    result = moe_tune.tune_shape("tiny-moe", torch.float32, torch.device("cpu"), (2, 40), fp8=True)
    assert result["file"] == moe.config_file_name(8, 32, 64, moe.FP8_TABLE_DTYPE, "Test GPU")
    assert set(result["table"]) == {2, 40}
    grouped = moe.tiles_from_json(result["table"][40])
    assert grouped == (moe.TileConfig(16, 32, 16, 1, 4, 2, act_fp8=True),) * 2  # the last candidate timed
    assert isinstance(moe.tiles_from_json(result["table"][2])[0], moe.GemvConfig)  # the GEMVs, timed last, won
    for row in result["rows"]:
        assert row["rel_err"] < 0.1  # e4m3 weights (and W8A8 activations) against the unquantized layer


def test_compile_gemm_tiles_launches_each_tile_on_both_gemms() -> None:
    tiles = [{"block_m": 16, "block_n": 32, "block_k": 32, "group_m": 1, "num_warps": 4, "num_stages": 2,
              "act_fp8": True}]
    assert moe_tune.compile_gemm_tiles("tiny-moe", True, None, "float32", tiles, device_name="cpu") == 2
