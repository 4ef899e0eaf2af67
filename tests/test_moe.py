"""The fused MoE kernels (kernels/moe.py) against the plain-PyTorch reference: routing, alignment, grouped GEMMs."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import moe
from pagoda.kernels import reference as ref

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)  # [E, 2I, H]
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype)  # [E, H, I]
    return w_gate_up, w_down


def _routed(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)  # [T, H]
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)  # [T, E]
    weights, ids = moe.route_softmax_topk(logits, TOP_K, renormalize=True)
    return x, weights, ids


ALIGNERS = [moe.align_pairs_triton, moe.align_pairs_sorted]


def _check_alignment(ids: torch.Tensor, block_m: int) -> None:
    for aligner in ALIGNERS:
        _check_layout(aligner(ids, EXPERTS, block_m), ids, block_m)


def _check_layout(align: moe.Alignment, ids: torch.Tensor, block_m: int) -> None:
    num_pairs = ids.numel()
    used = int(align.num_padded.item())
    assert used % block_m == 0
    pairs = align.sorted_pairs[:used]
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "every pair placed exactly once"
    assert bool((align.sorted_pairs[used:] == num_pairs).all()), "rows past the routed ones are padding"
    flat = ids.view(-1).long()
    for tile in range(align.tile_experts.numel()):
        expert = int(align.tile_experts[tile])
        rows = align.sorted_pairs[tile * block_m:(tile + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        if tile * block_m >= used:
            assert expert == -1 and rows.numel() == 0
        else:
            assert bool((flat[rows] == expert).all()), f"tile {tile} mixes experts"
    counts = torch.bincount(flat, minlength=EXPERTS)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_alignment_groups_pairs_by_expert(num_tokens: int) -> None:
    _, _, ids = _routed(num_tokens, torch.float32)
    for block_m in (16, 64):
        _check_alignment(ids, block_m)


def test_alignment_skewed_routing() -> None:
    ids = torch.zeros(40, TOP_K, dtype=torch.int32)
    ids[:, 1] = 5  # two experts get everything, six get nothing
    _check_alignment(ids, 16)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 4096])
def test_fused_experts_match_reference(num_tokens: int) -> None:
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, ids = _routed(num_tokens, torch.float32, seed=num_tokens)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids)
    expected = ref.moe_experts(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


# The interpreter's bf16 arithmetic is wrong: bf16 runs on the GPU only, fp16 also under the interpreter.
HALF_CASES = [pytest.param(torch.float16, "cpu"), pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize(("dtype", "device"), HALF_CASES)
@pytest.mark.parametrize("num_tokens", [1, 33, 1024])
def test_fused_experts_half_precision(dtype: torch.dtype, device: str, num_tokens: int) -> None:
    w_gate_up, w_down = (w.to(device) for w in _weights(dtype))
    x, weights, ids = (t.to(device) for t in _routed(num_tokens, dtype))
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids)
    expected = ref.moe_experts(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tile", [moe.TileConfig(16, 32, 32, 1, 4, 2), moe.TileConfig(32, 16, 16, 4, 4, 2),
                                  moe.GemvConfig(16, 32, 4, 2), moe.GemvConfig(64, 128, 4, 2)])
def test_fused_experts_every_token_to_one_expert(tile: moe.TileConfig | moe.GemvConfig) -> None:
    """Skewed routing: one expert takes every token's first slot, the second slot always goes to expert 3; the
    other six get nothing. Explicit tiles: several row tiles per expert, N and K over several tiles; the GEMV path
    (one program per pair), K split evenly and not."""
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, _ = _routed(50, torch.float32)
    ids = torch.empty(50, TOP_K, dtype=torch.int32)
    ids[:, 0], ids[:, 1] = 6, 3
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=(tile, tile))
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (60, 4), (128, 8)])
def test_router_kernel_matches_reference(num_experts: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(37, num_experts, generator=torch.Generator().manual_seed(num_experts)).half()  # [T, E]
    logits[3, :] = 0.5  # every expert tied: the lowest ids win
    weights, ids = moe.route_softmax_topk_triton(logits, top_k, renormalize)
    ref_weights, ref_ids = moe.route_softmax_topk_reference(logits, top_k, renormalize)
    assert ids[3].tolist() == list(range(top_k))  # (torch.topk's order among equals is its own: row 3 apart)
    rows = [r for r in range(37) if r != 3]
    assert torch.equal(ids[rows].sort(dim=1).values, ref_ids[rows].sort(dim=1).values)
    torch.testing.assert_close(weights.sort(dim=1).values, ref_weights.sort(dim=1).values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_router_appends_gated_shared_experts(impl: str) -> None:
    """Qwen2-MoE's shared expert fused as experts E, E + 1: the logits' last column is its gate; the routed picks
    are those of the first E columns, the shared ones follow with weight sigmoid(gate)."""
    logits = torch.randn(9, EXPERTS + 1, generator=torch.Generator().manual_seed(4))  # [T, E + 1]
    route = moe.route_softmax_topk_triton if impl == "triton" else moe.route_softmax_topk_reference
    weights, ids = route(logits, TOP_K, True, 2)
    routed_weights, routed_ids = route(logits[:, :EXPERTS].contiguous(), TOP_K, True)
    assert ids.shape == weights.shape == (9, TOP_K + 2)
    assert torch.equal(ids[:, :TOP_K], routed_ids) and torch.equal(weights[:, :TOP_K], routed_weights)
    assert ids[:, TOP_K:].tolist() == [[EXPERTS, EXPERTS + 1]] * 9
    gate = logits[:, EXPERTS:].sigmoid()  # [T, 1]
    torch.testing.assert_close(weights[:, TOP_K:], gate.expand(9, 2))


def test_router_ties_take_the_lower_expert() -> None:
    """Equal router logits: the top-k follows torch.topk (lower ids first), the weights renormalise to 1, and the
    fused layer matches the reference on that routing."""
    logits = torch.zeros(5, EXPERTS)
    logits[:, [2, 4, 6]] = 1.0  # a three-way tie for two slots
    weights, ids = moe.route_softmax_topk(logits, TOP_K, renormalize=True)
    assert ids.tolist() == [[2, 4]] * 5
    torch.testing.assert_close(weights, torch.full((5, TOP_K), 0.5))
    unnormalised, _ = moe.route_softmax_topk(logits, TOP_K, renormalize=False)
    assert bool((unnormalised.sum(-1) < 1).all())
    w_gate_up, w_down = _weights(torch.float32)
    x = torch.randn(5, HIDDEN)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("group_k", [None, 16])
def test_fused_experts_fp8_weights(group_k: int | None, gemv: bool) -> None:
    """Weight-only FP8 experts (per row, or per row and 16 columns): the kernel converts e4m3 in registers and
    applies the scales; the reference dequantizes the same weights."""
    w_gate_up, w_down = _weights(torch.float32)
    q_up, s_up = zip(*(ref.quantize_fp8_rows(w, group_k) for w in w_gate_up), strict=True)
    q_down, s_down = zip(*(ref.quantize_fp8_rows(w, group_k) for w in w_down), strict=True)
    q_up, s_up, q_down, s_down = (torch.stack(t) for t in (q_up, s_up, q_down, s_down))
    x, weights, ids = _routed(24, torch.float32)
    tiles = (moe.GemvConfig(16, 64), moe.GemvConfig(16, 64)) if gemv else None
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=tiles)
    expected = ref.moe_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    close = ref.moe_experts(x, w_gate_up, w_down, weights, ids)  # and near the unquantized layer
    assert (got - close).abs().max() < 0.1 * close.abs().max()


def test_tile_lookup_falls_back_to_default() -> None:
    assert moe.pick_tiles(3, TOP_K, EXPERTS, INTER, HIDDEN, torch.bfloat16, torch.device("cpu")) == \
        moe.default_tiles(3, TOP_K, EXPERTS, INTER, HIDDEN)
    up, down = moe.default_tiles(1, 8, 128, 768, 2048)  # 8 pairs over 128 experts: GEMVs
    assert isinstance(up, moe.GemvConfig) and isinstance(down, moe.GemvConfig)
    assert (up.block_n, up.block_k, down.block_n, down.block_k) == (8, 512, 16, 256)  # rows of 2048, of 768
    assert moe.default_gemv(14336).block_k == 1024 and moe.default_gemv(14336).block_n == 4
    assert moe.default_tile(1, 8, 128).block_m == 16 and moe.default_tile(4096, 8, 128).block_m == 64
    for tiles in (moe.default_tiles(1, 8, 128, 768, 2048), moe.default_tiles(4096, 8, 128, 768, 2048)):
        assert moe.tiles_from_json(moe.tiles_to_json(tiles)) == tiles


def test_large_batches_align_by_sorting() -> None:
    """Past ALIGN_SORT_MIN_PAIRS pairs the layout comes from the sort; the layer still matches the reference."""
    num_tokens = moe.ALIGN_SORT_MIN_PAIRS // TOP_K + 5
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, ids = _routed(num_tokens, torch.float32, seed=11)
    tile = moe.TileConfig(64, 32, 64, 8, 4, 2)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=(tile, tile))
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)
