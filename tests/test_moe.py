"""The fused MoE kernels (kernels/moe.py) against the plain-PyTorch reference: routing, alignment, grouped GEMMs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagoda.kernels import moe
from pagoda.kernels import reference as ref
from pagoda.services.worker.models.base import Fp8Weights, make_linear

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 2


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)  # [E, 2I, H]
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype)  # [E, H, I]
    return w_gate_up, w_down


def _fp8_weights(group_k: int | None) -> tuple[torch.Tensor, ...]:
    """_weights in fp32, each expert quantized to e4m3 per row (and group_k columns): q_up, s_up, q_down, s_down."""
    w_gate_up, w_down = _weights(torch.float32)
    q_up, s_up = zip(*(ref.quantize_fp8_rows(w, group_k) for w in w_gate_up), strict=True)
    q_down, s_down = zip(*(ref.quantize_fp8_rows(w, group_k) for w in w_down), strict=True)
    return tuple(torch.stack(t) for t in (q_up, s_up, q_down, s_down))


def _routed(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)  # [T, H]
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)  # [T, E]
    weights, ids = moe.route_softmax_topk(logits, TOP_K, renormalize=True)
    return x, weights, ids


ALIGNERS = [moe.align_pairs_triton, moe.align_pairs_sorted, moe.align_pairs_spread, moe.align_pairs_by_expert]


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
    assert align.run_ends.dtype == torch.int32
    assert torch.equal(align.run_ends, moe.expert_offsets(ids, EXPERTS, block_m)), "each expert's run end"


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512])
def test_alignment_groups_pairs_by_expert(num_tokens: int) -> None:
    _, _, ids = _routed(num_tokens, torch.float32)
    for block_m in (16, 64):
        _check_alignment(ids, block_m)


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_spread_alignment_over_many_programs(routing: str) -> None:
    """The multi-program alignment (prefill's, on CUDA) with pairs over several chunks: the counts of every chunk
    meet in one histogram and the placements of every chunk in one layout, at each block_m the tiles use."""
    num_tokens = (2 * moe.SPREAD_CHUNK + 300) // TOP_K  # three programs, the last one partial
    _, _, ids = _routed(num_tokens, torch.float32, seed=4)
    if routing == "skewed":
        ids[:, 0] = 3  # one expert takes every token's first pick
    for block_m in (1, 16, 64, 128):
        _check_layout(moe.align_pairs_spread(ids, EXPERTS, block_m), ids, block_m)
    with pytest.raises(ValueError, match="contiguous int32"):
        moe.align_pairs_spread(ids.long(), EXPERTS, 16)
    with pytest.raises(ValueError, match="contiguous int32"):
        moe.align_pairs_spread(ids.t(), EXPERTS, 16)
    with pytest.raises(ValueError, match="block_m must be >= 1"):
        moe.align_pairs_spread(ids, EXPERTS, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_tokens", [3, (moe.ALIGN_BY_EXPERT_CHUNK + 300) // TOP_K])  # small; two chunks
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_alignment_by_expert_equals_the_stable_sort(routing: str, num_tokens: int, device: str) -> None:
    """A program per expert ranks its pairs in pair order: the very layout of the stable sort (rows, tiles, runs),
    in one chunk and over several (the second partial), at every block_m, with experts that get nothing."""
    _, _, ids = _routed(num_tokens, torch.float32, seed=5)
    ids = ids.to(device)
    if routing == "skewed":
        ids[:, :2] = torch.tensor([3, 5], dtype=torch.int32, device=device)  # two experts take every pick
    for block_m in (1, 16, 64):
        got = moe.align_pairs_by_expert(ids, EXPERTS, block_m)
        want = moe.align_pairs_sorted(ids, EXPERTS, block_m)
        for field in ("sorted_pairs", "tile_experts", "num_padded", "run_ends"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (field, block_m)


def test_decode_alignment_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches over ALIGN_BY_EXPERT_MIN_EXPERTS or more experts take the program-per-expert layout, fewer
    experts the one-program kernel; either way the layout is valid."""
    taken: list[str] = []
    for name in ("align_pairs_by_expert", "align_pairs_triton"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *args, _real=real, _name=name: taken.append(_name) or _real(*args))
    gen = torch.Generator().manual_seed(11)
    for experts in (moe.ALIGN_BY_EXPERT_MIN_EXPERTS + 34, EXPERTS):  # deepseek-v2-lite's 66; the tests' 8
        ids = torch.rand(37, experts, generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)  # [T, k]
        align = moe.align_pairs(ids, experts, 16)
        assert int(align.num_padded) == int(moe.expert_offsets(ids, experts, 16)[-1])
    assert taken == ["align_pairs_by_expert", "align_pairs_triton"]


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


@pytest.mark.parametrize("top_k", [2, 3, 8])
@pytest.mark.parametrize("down", [moe.GemvConfig(16, 16, 4, 2, pairs_at_once=True),
                                  moe.GemvConfig(8, 64, 4, 3, pairs_at_once=True),
                                  moe.GemvConfig(2, 32, 4, 3, pairs_at_once=True),
                                  moe.GemvConfig(1, 64, 2, 3, pairs_at_once=True)])
def test_down_gemv_with_every_pair_at_once_matches_reference(top_k: int, down: moe.GemvConfig) -> None:
    """The down GEMV loading every pair of a token in each K-step: a power-of-two pair count and not (3: padded
    to 4, as V3's 8 routed + 1 shared to 16), K over two steps or one, beside the plain gate/up GEMV."""
    w_gate_up, w_down = _weights(torch.float32)
    gen = torch.Generator().manual_seed(top_k)
    x = torch.randn(5, HIDDEN, generator=gen)  # [T, H]
    weights, ids = moe.route_softmax_topk(torch.randn(5, EXPERTS, generator=gen), top_k, renormalize=True)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=(moe.GemvConfig(16, 32, 4, 2), down))
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)


def test_pairs_at_once_is_refused_where_it_does_not_apply() -> None:
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, ids = _routed(3, torch.float32)
    with pytest.raises(ValueError, match="pairs_at_once"):
        moe.fused_experts(x, w_gate_up, w_down, weights, ids,
                          tiles=(moe.GemvConfig(16, 32, pairs_at_once=True), moe.GemvConfig(16, 32)))


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


@pytest.mark.parametrize("gemv", [False, True, "pairs"])
@pytest.mark.parametrize("group_k", [None, 16])
def test_fused_experts_fp8_weights(group_k: int | None, gemv: bool | str) -> None:
    """Weight-only FP8 experts (per row, or per row and 16 columns): the kernel converts e4m3 in registers and
    applies the scales; the reference dequantizes the same weights."""
    w_gate_up, w_down = _weights(torch.float32)
    q_up, s_up, q_down, s_down = _fp8_weights(group_k)
    x, weights, ids = _routed(24, torch.float32)
    tiles = (moe.GemvConfig(16, 64), moe.GemvConfig(16, 64, pairs_at_once=gemv == "pairs")) if gemv else None
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=tiles)
    expected = ref.moe_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    close = ref.moe_experts(x, w_gate_up, w_down, weights, ids)  # and near the unquantized layer
    assert (got - close).abs().max() < 0.1 * close.abs().max()


@pytest.mark.parametrize("group_k", [None, 32])
def test_fused_experts_fp8_w8a8_for_large_batches(group_k: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 experts with act_fp8 tiles (W8A8: each activation tile quantized per row where the grouped GEMM loads it,
    the e4m3 weight tile multiplied as loaded): equal to the W8A8 reference at the kernel's K tiles, near the
    weight-only result. Each GEMM follows its own tile's act_fp8 (an FP8 table's choice);
    PAGODA_MOE_ACT_FP8 overrides it: 1 always, 0 never, auto from ACT_FP8_MIN_ROWS_PER_EXPERT rows an expert."""
    monkeypatch.delenv("PAGODA_MOE_ACT_FP8", raising=False)
    q_up, s_up, q_down, s_down = _fp8_weights(group_k)
    x, weights, ids = _routed(24, torch.float32)
    weight_only_tiles = (moe.TileConfig(16, 32, 32, 1, 4, 2), moe.TileConfig(16, 32, 16, 1, 4, 2))
    w8a8_tiles = tuple(replace(tile, act_fp8=True) for tile in weight_only_tiles)
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=w8a8_tiles)
    expected = ref.moe_experts_act_fp8(x, q_up, q_down, weights, ids, s_up, s_down, group_k, 32, 16)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    weight_only = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=weight_only_tiles)
    torch.testing.assert_close(weight_only, ref.moe_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k),
                               atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got, weight_only)  # the activations were quantized ...
    assert (got - weight_only).abs().max() < 0.1 * weight_only.abs().max()  # ... to e4m3's precision
    mixed = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k,
                              tiles=(w8a8_tiles[0], weight_only_tiles[1]))  # W8A8 gate_up, weight-only down
    assert not torch.allclose(mixed, got) and not torch.allclose(mixed, weight_only)
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "1")
    torch.testing.assert_close(
        moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=weight_only_tiles), got)
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "0")
    torch.testing.assert_close(
        moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=w8a8_tiles), weight_only)


def test_act_fp8_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, tile = moe.ACT_FP8_MIN_ROWS_PER_EXPERT, moe.TileConfig()
    monkeypatch.delenv("PAGODA_MOE_ACT_FP8", raising=False)
    assert not moe.moe_act_fp8(rows * EXPERTS, EXPERTS, tile)  # the tile's: weight-only
    assert moe.moe_act_fp8(1, EXPERTS, replace(tile, act_fp8=True))
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "auto")
    assert moe.moe_act_fp8(rows * EXPERTS, EXPERTS, tile) and not moe.moe_act_fp8(rows * EXPERTS - 1, EXPERTS, tile)
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "table")
    assert not moe.moe_act_fp8(rows * EXPERTS, EXPERTS, tile)
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "yes")
    with pytest.raises(ValueError, match="PAGODA_MOE_ACT_FP8"):
        moe.moe_act_fp8(1, EXPERTS, tile)


def test_fp8_table_only_from_its_smallest_bucket_up() -> None:
    """FP8 experts take the FP8 table's nearest bucket from its smallest one up, the bf16 table's nearest bucket
    below: a table tuned from 256 tokens must not give one token its grouped-GEMM tiles."""
    gemv = (moe.GemvConfig(block_n=8, block_k=512), moe.GemvConfig(block_n=2, block_k=128))
    bf16 = {1: gemv, 1024: (moe.TileConfig(block_m=128), moe.TileConfig(block_m=128))}
    fp8 = {256: (moe.TileConfig(block_m=32), moe.TileConfig(block_m=32)),
           1024: (moe.TileConfig(block_m=64, act_fp8=True), moe.TileConfig(block_m=64))}
    assert moe.tiles_from_tables(1000, fp8, bf16) == fp8[1024]
    assert moe.tiles_from_tables(16384, fp8, bf16) == fp8[1024]  # above the table: its largest bucket
    assert moe.tiles_from_tables(300, fp8, bf16) == fp8[256]
    assert moe.tiles_from_tables(200, fp8, bf16) == fp8[256]
    assert moe.tiles_from_tables(128, fp8, bf16) == bf16[1024]  # below it: the bf16 table's nearest
    assert moe.tiles_from_tables(1, fp8, bf16) == gemv
    assert moe.tiles_from_tables(1000, None, bf16) == bf16[1024]
    assert moe.tiles_from_tables(1, None, None) is None
    entry = moe.tiles_to_json(fp8[1024])
    assert entry["gate_up"]["act_fp8"] is True and "act_fp8" not in entry["down"]  # bf16 tables stay as written
    assert moe.tiles_from_json(entry) == fp8[1024]
    # a K-tile fitted into a scale group keeps the tile's choice
    assert moe._fit_block_k(moe.TileConfig(block_k=256, act_fp8=True), 128, 2048) == \
        moe.TileConfig(block_k=128, act_fp8=True)


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


def test_gemm_tile_shrinks_until_it_launches() -> None:
    """A launch that Triton refuses for shared memory (fp32 operands on a tile tuned for bf16, as the tiny test
    models on an H200) is retried with fewer stages, then narrower blocks; the tile that launched is remembered, so
    the next launch goes to it at once. A tile that launches is left as it is."""
    from triton.runtime.errors import OutOfResources

    big = moe.TileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
    tried: list[moe.TileConfig] = []

    def launch(tile: moe.TileConfig) -> None:  # an H200's limit on fp32 stages: A [M, K] + gate and up [K, N]
        tried.append(tile)
        need = tile.num_stages * 4 * (tile.block_m * tile.block_k + 2 * tile.block_k * tile.block_n)
        if need > 232_448:
            raise OutOfResources(need, 232_448, "shared memory")

    key = ("test", id(tried))
    used = moe.launch_fitting(launch, big, key)
    assert tried == [big, replace(big, num_stages=3), replace(big, num_stages=2)] and used == tried[-1]
    tried.clear()
    assert moe.launch_fitting(launch, big, key) == used and tried == [used]  # remembered
    tried.clear()
    small = moe.TileConfig(16, 32, 64, 1, 4, 3)
    assert moe.launch_fitting(launch, small, key) == small and tried == [small]
    assert moe.smaller_tile(replace(big, num_stages=2)) == replace(big, num_stages=2, block_n=64)
    assert moe.smaller_tile(moe.TileConfig(16, 16, 64, 1, 4, 2)).block_k == 32
    with pytest.raises(ValueError, match="no smaller MoE GEMM tile"):
        moe.smaller_tile(moe.TileConfig(16, 16, 16, 1, 4, 2))


def test_large_batches_align_by_sorting() -> None:
    """Past ALIGN_SORT_MIN_PAIRS pairs the layout comes from the sort; the layer still matches the reference."""
    num_tokens = moe.ALIGN_SORT_MIN_PAIRS // TOP_K + 5
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, ids = _routed(num_tokens, torch.float32, seed=11)
    tile = moe.TileConfig(64, 32, 64, 8, 4, 2)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=(tile, tile))
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- the gmm path (torch._grouped_mm)

needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


def _gmm_routing(kind: str, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int32) of one routing kind: "top1", "top2" (softmax top-k over all experts),
    "skewed" (experts 0-2 only, most pairs on expert 0: five experts get nothing), "shared" (top 2 of the first six,
    then experts 6 and 7 with weight 1, as DeepSeek-V2-Lite's fused shared experts)."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("top1", "top2"):
        return moe.route_softmax_topk(torch.randn(num_tokens, EXPERTS, generator=gen), int(kind[-1]), True)
    if kind == "skewed":
        ids = torch.multinomial(torch.tensor([0.8, 0.15, 0.05]), num_tokens * 2, replacement=True, generator=gen)
        ids = ids.view(num_tokens, 2).to(torch.int32)  # an expert may appear twice in a row: harmless here
        return torch.rand(num_tokens, 2, generator=gen), ids
    assert kind == "shared"
    weights, ids = moe.route_softmax_topk(torch.randn(num_tokens, EXPERTS - 2, generator=gen), 2, True)
    shared = torch.tensor([EXPERTS - 2, EXPERTS - 1], dtype=torch.int32).expand(num_tokens, 2)
    return torch.cat((weights, torch.ones(num_tokens, 2)), 1), torch.cat((ids, shared), 1)  # [T, 4] each


@needs_grouped_mm
@pytest.mark.parametrize(("kind", "num_tokens"), [("top1", 9), ("top2", 33), ("skewed", 40), ("shared", 17)])
def test_gmm_path_matches_reference(kind: str, num_tokens: int) -> None:
    """path="gmm" on CPU (torch._grouped_mm's CPU kernel, the gather and combine kernels interpreted): the layer of
    the reference and of the Triton path, whatever the routing leaves empty or uneven."""
    w_gate_up, w_down = _weights(torch.float32)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))  # [T, H]
    weights, ids = _gmm_routing(kind, num_tokens, seed=num_tokens)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="gmm")
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)
    triton_path = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="triton")
    torch.testing.assert_close(got, triton_path, atol=2e-5, rtol=1e-4)


@needs_grouped_mm
def test_gmm_path_half_precision_matches_triton_path() -> None:
    """fp16 (the interpreter's bf16 is wrong; bf16 is the GPU's case): the two paths round alike, gate before SiLU,
    each weighted product before the top-k sum."""
    w_gate_up, w_down = _weights(torch.float16)
    x, weights, ids = _routed(24, torch.float16)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="gmm")
    triton_path = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="triton")
    torch.testing.assert_close(got.float(), triton_path.float(), atol=2e-3, rtol=2e-3)
    expected = ref.moe_experts(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@needs_grouped_mm
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # SiLU of the unwritten rows past num_padded: never read
def test_gmm_path_with_padded_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """GMM_BLOCK_M > 1: every expert's run padded to 16 rows (sentinel rows in the GEMMs' input); same layer."""
    monkeypatch.setattr(moe, "GMM_BLOCK_M", 16)
    w_gate_up, w_down = _weights(torch.float32)
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(5))
    weights, ids = _gmm_routing("skewed", 21, seed=5)
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="gmm")
    torch.testing.assert_close(got, ref.moe_experts(x, w_gate_up, w_down, weights, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_m", [1, 16])
def test_gather_sorted_and_offsets_follow_the_alignment(block_m: int) -> None:
    """The gmm path's layout: offs ends each expert's run of align_pairs (offs[-1] = num_padded), gathered rows are
    x's row of their pair (zero for padding), positions invert the sort."""
    top_k = 2
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(2))  # [T, H]
    _, ids = _gmm_routing("skewed", 13, seed=3)
    align = moe.align_pairs(ids, EXPERTS, block_m)
    offs = align.run_ends  # the grouped GEMM's offs
    assert torch.equal(offs, moe.expert_offsets(ids, EXPERTS, block_m))
    assert offs.dtype == torch.int32 and offs.shape == (EXPERTS,)
    assert int(offs[-1]) == int(align.num_padded)
    starts = torch.cat((offs.new_zeros(1), offs[:-1]))  # [E]
    for expert in range(EXPERTS):
        tiles = align.tile_experts[int(starts[expert]) // block_m:int(offs[expert]) // block_m]
        assert bool((tiles == expert).all()), f"expert {expert}'s run"
    rows, positions = moe.gather_sorted(x, align, top_k)
    used = int(align.num_padded)
    pairs = align.sorted_pairs[:used].long()
    real = pairs < ids.numel()
    torch.testing.assert_close(rows[:used][real], x[pairs[real] // top_k], atol=0, rtol=0)
    assert bool((rows[:used][~real] == 0).all()), "padding rows are zero"
    assert torch.equal(align.sorted_pairs[positions.long()].long(), torch.arange(ids.numel()))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton", "gmm"])
def test_prefill_batches_align_over_the_whole_gpu(path: str) -> None:
    """Past ALIGN_SORT_MIN_PAIRS pairs on CUDA the layout comes from the spread alignment (no sort): both paths of a
    bf16 layer still match the reference."""
    num_tokens = 2 * moe.ALIGN_SORT_MIN_PAIRS // TOP_K + 7
    w_gate_up, w_down = (w.cuda() for w in _weights(torch.bfloat16))
    x, weights, ids = (t.cuda() for t in _routed(num_tokens, torch.bfloat16, seed=9))
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path=path)
    expected = ref.moe_experts(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


def _assert_near_quantized(got: torch.Tensor, expected: torch.Tensor) -> None:
    """W8A8 on the GPU against its reference: the intermediate is rounded to bf16 before it is quantized again, and a
    last-bit difference there moves a value across an e4m3 rounding boundary (one e4m3 step is 1/8 of the value), so
    a few elements differ by ~0.1 (H100, 2026-12-06: 9-21 of 32k-131k). A wrong scale or tile moves many: the whole
    result must be close in norm and all but 0.5% of the elements within 5e-2."""
    assert ((got - expected).norm() / expected.norm()).item() < 0.02
    far = (got - expected).abs() > 5e-2 + 5e-2 * expected.abs()
    assert far.float().mean().item() < 0.005, f"{int(far.sum())} of {far.numel()} elements off"


@pytest.mark.gpu
@pytest.mark.parametrize("group_k", [None, 32])
def test_fp8_w8a8_experts_on_the_gpu(group_k: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The W8A8 grouped GEMM (act_fp8) with bf16 activations on fp8 tensor cores, default tiles for a prefill-sized
    batch: near the W8A8 reference (bf16 rounding of the intermediate and the output apart)."""
    q_up, s_up, q_down, s_down = (t.cuda() for t in _fp8_weights(group_k))
    x, weights, ids = (t.cuda() for t in _routed(512, torch.bfloat16, seed=3))
    monkeypatch.setenv("PAGODA_MOE_ACT_FP8", "1")
    tiles = moe.pick_tiles(512, TOP_K, EXPERTS, INTER, HIDDEN, torch.bfloat16, x.device)
    assert isinstance(tiles[0], moe.TileConfig) and isinstance(tiles[1], moe.TileConfig)
    up_tile = moe._fit_block_k(tiles[0], group_k or HIDDEN, HIDDEN)
    down_tile = moe._fit_block_k(tiles[1], group_k or INTER, INTER)
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, group_k, tiles=tiles)
    expected = ref.moe_experts_act_fp8(x.float(), q_up, q_down, weights, ids, s_up, s_down, group_k,
                                       min(up_tile.block_k, HIDDEN), min(down_tile.block_k, INTER))
    _assert_near_quantized(got.float(), expected)


def _fake_scaled_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                            offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                            scale_result: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                            use_fast_accum: bool = False) -> torch.Tensor:
    """torch._scaled_grouped_mm's 2D x 3D case in fp32 on the CPU, with the layout its meta function checks (row-major
    A, column-major B, scale_a one per row of A, scale_b [groups, N]) and the 16-row groups the FP8 path pads to."""
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and bias is None and scale_result is None
    assert mat_a.dim() == 2 and mat_b.dim() == 3 and mat_a.shape[1] == mat_b.shape[1]
    assert mat_a.stride(1) == 1 and mat_b.stride(1) == 1 and mat_b.stride(2) > 1
    assert scale_a.shape == (mat_a.shape[0],) and scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_b.shape == (mat_b.shape[0], mat_b.shape[2]) and scale_b.stride(-1) == 1
    assert offs is not None and offs.dtype == torch.int32 and offs.shape == (mat_b.shape[0],)
    assert bool((offs % moe.GMM_FP8_BLOCK_M == 0).all())
    out = torch.zeros(mat_a.shape[0], mat_b.shape[2], dtype=out_dtype or torch.bfloat16)  # [M, N]
    start = 0
    for group, end in enumerate(offs.tolist()):
        a = mat_a[start:end].float() * scale_a[start:end, None]  # [rows, K]
        out[start:end] = (a @ (mat_b[group].float() * scale_b[group][None, :])).to(out.dtype)
        start = end
    return out


def test_gather_sorted_fp8_moves_bytes_and_token_scales() -> None:
    top_k = 2
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(4))  # [T, H]
    x_q, x_scale = ref.quantize_fp8_rows(x)  # [T, H], [T, 1]
    _, ids = _gmm_routing("skewed", 13, seed=6)
    align = moe.align_pairs(ids, EXPERTS, moe.GMM_FP8_BLOCK_M)
    rows, row_scales, positions = moe.gather_sorted_fp8(x_q, x_scale, align, top_k)
    used = int(align.num_padded)
    pairs = align.sorted_pairs[:used].long()
    real = pairs < ids.numel()
    assert rows.dtype == torch.float8_e4m3fn
    assert torch.equal(rows[:used][real].view(torch.uint8), x_q[pairs[real] // top_k].view(torch.uint8))
    assert bool((rows[:used][~real].view(torch.uint8) == 0).all()), "padding rows are +0"
    assert torch.equal(row_scales[:used][real], x_scale.view(-1)[pairs[real] // top_k])
    assert bool((row_scales[:used][~real] == 1).all())
    assert torch.equal(align.sorted_pairs[positions.long()].long(), torch.arange(ids.numel()))


@pytest.mark.parametrize("kind", ["top2", "skewed", "shared"])
def test_fp8_gmm_path_against_its_reference(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 experts with per-row scales on the gmm path (per-row W8A8 on torch._scaled_grouped_mm, here the CPU
    stand-in above): the quantize, gather, SiLU-and-mul-quantize and combine kernels around the two grouped GEMMs
    give reference.moe_experts_w8a8_rows; and it stays near the unquantized layer."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_scaled_grouped_mm, raising=False)
    q_up, s_up, q_down, s_down = _fp8_weights(None)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(8))  # [T, H]
    weights, ids = _gmm_routing(kind, 37, seed=8)
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, path="gmm")
    expected = ref.moe_experts_w8a8_rows(x, q_up, q_down, weights, ids, s_up, s_down)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    w_gate_up, w_down = _weights(torch.float32)
    unquantized = ref.moe_experts(x, w_gate_up, w_down, weights, ids)
    assert ((got - unquantized).norm() / unquantized.norm()).item() < 0.08


def _with_spare_expert(t: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    return moe.with_spare_expert(t.shape, t.dtype, device, like=t)


def test_make_linear_gives_spare_room_to_the_fp8_experts_that_may_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-row FP8 experts of a shape in GMM_FP8_SPLIT_MAX_M (gate_up [E, 2I, H] and down [E, H, I]) are allocated
    over storage for one more expert; others, and block-scaled ones, as they are."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(moe, "GMM_FP8_SPLIT_MAX_M", {(EXPERTS, INTER, HIDDEN): 256})
    for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        weight, scale = make_linear(rows, cols, torch.bfloat16, cpu, Fp8Weights(group_size=None), EXPERTS)
        assert weight.shape == (EXPERTS, rows, cols) and scale.shape == (EXPERTS, rows, 1)
        assert weight.untyped_storage().nbytes() == (EXPERTS + 1) * rows * cols
        assert scale.untyped_storage().nbytes() == (EXPERTS + 1) * rows * 4
        blocked, _ = make_linear(rows, cols, torch.bfloat16, cpu, Fp8Weights(group_size=16), EXPERTS)
        assert blocked.untyped_storage().nbytes() == EXPERTS * rows * cols  # block-scaled: never on gmm
    monkeypatch.setattr(moe, "GMM_FP8_SPLIT_MAX_M", {})
    weight, _ = make_linear(2 * INTER, HIDDEN, torch.bfloat16, cpu, Fp8Weights(group_size=None), EXPERTS)
    assert weight.untyped_storage().nbytes() == EXPERTS * 2 * INTER * HIDDEN  # a shape that never splits


def test_expert_split_keeps_torch_small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 gmm path hands torch._scaled_grouped_mm f groups an expert so that rows / (E f) stays within the small
    tiles' M, up to the shape's measured bound, where the weights' storage has room past the last expert; the views'
    group e f is expert e with its run, the other groups empty."""
    monkeypatch.delenv("PAGODA_MOE_FP8_GMM_SPLIT", raising=False)
    q_up, s_up, _, _ = _fp8_weights(None)
    spare_w, spare_s = _with_spare_expert(q_up), _with_spare_expert(s_up)
    small, most = moe.GMM_FP8_SMALL_TILE_M * EXPERTS, 272
    assert moe.expert_split(small + EXPERTS - 1, spare_w, spare_s, most) == 1  # rows // E = M: the small tiles
    assert moe.expert_split(small + EXPERTS, spare_w, spare_s, most) == 2
    assert moe.expert_split(2 * small + 2 * EXPERTS - 1, spare_w, spare_s, most) == 2
    assert moe.expert_split(2 * small + 2 * EXPERTS, spare_w, spare_s, most) == 4
    assert moe.expert_split(most * EXPERTS + EXPERTS - 1, spare_w, spare_s, most) > 1
    assert moe.expert_split(most * EXPERTS + EXPERTS, spare_w, spare_s, most) == 1, "past the shape's bound"
    assert moe.expert_split(small + EXPERTS, spare_w, spare_s, moe.GMM_FP8_SMALL_TILE_M) == 1, "a shape not measured"
    assert moe.expert_split(small + EXPERTS, q_up, s_up, most) == 1, "no room past the last expert: no split"
    monkeypatch.setattr(moe, "CUTLASS_MAX_GROUPS", 2 * EXPERTS - 1)
    assert moe.expert_split(small + EXPERTS, spare_w, spare_s, most) == 1, "at most CUTLASS_MAX_GROUPS groups"
    monkeypatch.setattr(moe, "CUTLASS_MAX_GROUPS", 1023)
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM_SPLIT", "0")
    assert moe.expert_split(small + EXPERTS, spare_w, spare_s, most) == 1
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM_SPLIT", "yes")
    with pytest.raises(ValueError, match="PAGODA_MOE_FP8_GMM_SPLIT"):
        moe.expert_split(small + EXPERTS, spare_w, spare_s, most)
    offs = torch.tensor([16, 16, 48, 64, 64, 96, 112, 128], dtype=torch.int32)  # [E]
    views, scales, offs_split = moe.expert_group_views(spare_w, spare_s, offs, 4)
    assert views.shape == (4 * EXPERTS, 2 * INTER, HIDDEN) and scales.shape == (4 * EXPERTS, 2 * INTER)
    for e in range(EXPERTS):
        assert torch.equal(views[4 * e].view(torch.uint8), q_up[e].view(torch.uint8))
        assert torch.equal(scales[4 * e], s_up[e, :, 0])
    assert torch.equal(offs_split, offs.repeat_interleave(4))


def test_fp8_gmm_path_with_split_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gmm path with each expert split into groups (the small-tile limit lowered so that 37 tokens split, the
    test's shape given a bound) gives what it gives unsplit: reference.moe_experts_w8a8_rows; a shape without a
    bound is not split."""
    monkeypatch.setattr(moe, "GMM_FP8_SMALL_TILE_M", 4)
    monkeypatch.delenv("PAGODA_MOE_FP8_GMM_SPLIT", raising=False)
    q_up, s_up, q_down, s_down = (_with_spare_expert(t) for t in _fp8_weights(None))
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(9))  # [T, H]
    weights, ids = _gmm_routing("skewed", 37, seed=9)
    expected = ref.moe_experts_w8a8_rows(x, q_up, q_down, weights, ids, s_up, s_down)
    groups: list[int] = []

    def counting(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        groups.append(mat_b.shape[0])
        return _fake_scaled_grouped_mm(mat_a, mat_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", counting, raising=False)
    for bound, split in (({}, False), ({(EXPERTS, INTER, HIDDEN): 64}, True)):
        monkeypatch.setattr(moe, "GMM_FP8_SPLIT_MAX_M", bound)
        groups.clear()
        got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, path="gmm")
        assert len(groups) == 2 and all((g > EXPERTS) == split for g in groups), (bound, groups)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fp8_gmm_path_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 experts with per-row scales take the gmm path from FP8_GMM_MIN_ROWS_PER_EXPERT rows an expert on a device
    with CUTLASS's FP8 grouped GEMM (PAGODA_MOE_FP8_GMM: 0 never, 1 at any size); block-scaled FP8 experts never, and
    they are refused on it."""
    monkeypatch.setattr(moe, "scaled_grouped_mm_device", lambda index: True)
    cuda, bf16, fp8 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn
    at = moe.FP8_GMM_MIN_ROWS_PER_EXPERT * 66 // 8  # tokens: that many rows for each of 66 experts at 8 a token
    monkeypatch.delenv("PAGODA_MOE_FP8_GMM", raising=False)
    assert moe.moe_path(cuda, bf16, fp8, at, 8, 66, 2048, 1408, fp8_per_row=True) == "gmm"
    assert moe.moe_path(cuda, bf16, fp8, at - 1, 8, 66, 2048, 1408, fp8_per_row=True) == "triton"
    assert moe.moe_path(cuda, bf16, fp8, at, 8, 66, 2048, 1408, fp8_per_row=False) == "triton"
    assert moe.moe_path(cuda, bf16, fp8, at, 8, 66, 2048, 1400, fp8_per_row=True) == "triton"  # 1400 % 16
    assert moe.moe_path(torch.device("cpu"), bf16, fp8, at, 8, 66, 2048, 1408, fp8_per_row=True) == "triton"
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM", "1")
    assert moe.moe_path(cuda, bf16, fp8, 1, 8, 66, 2048, 1408, fp8_per_row=True) == "gmm"
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM", "0")
    assert moe.moe_path(cuda, bf16, fp8, 10 * at, 8, 66, 2048, 1408, fp8_per_row=True) == "triton"
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM", "auto")
    monkeypatch.setattr(moe, "scaled_grouped_mm_device", lambda index: False)
    assert moe.moe_path(cuda, bf16, fp8, at, 8, 66, 2048, 1408, fp8_per_row=True) == "triton"
    monkeypatch.setenv("PAGODA_MOE_FP8_GMM", "yes")
    with pytest.raises(ValueError, match="PAGODA_MOE_FP8_GMM"):
        moe.moe_path(cuda, bf16, fp8, at, 8, 66, 2048, 1408, fp8_per_row=True)
    q_up, s_up, q_down, s_down = _fp8_weights(32)
    x, weights, ids = _routed(3, torch.float32)
    with pytest.raises(ValueError, match="one fp32 scale per weight row"):
        moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, 32, path="gmm")


@pytest.mark.gpu
def test_fp8_gmm_path_on_the_gpu_captures_in_a_graph() -> None:
    """The FP8 gmm path on CUTLASS's FP8 grouped GEMM (sm90): near reference.moe_experts_w8a8_rows (bf16 rounding
    of the intermediate and fast accumulation apart), and it captures in a CUDA graph."""
    if not moe.scaled_grouped_mm_device(torch.cuda.current_device()):
        pytest.skip("torch._scaled_grouped_mm has no CUTLASS FP8 kernel for this device")
    q_up, s_up, q_down, s_down = (t.cuda() for t in _fp8_weights(None))
    num_tokens = moe.GMM_MIN_ROWS_PER_EXPERT * EXPERTS // TOP_K
    x, weights, ids = (t.cuda() for t in _routed(num_tokens, torch.bfloat16, seed=3))
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, path="gmm")
    expected = ref.moe_experts_w8a8_rows(x, q_up, q_down, weights, ids, s_up, s_down)
    _assert_near_quantized(got.float(), expected.float())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, path="gmm")
    graph.replay()
    torch.testing.assert_close(captured, got, atol=0, rtol=0)


@pytest.mark.gpu
def test_fp8_gmm_path_with_split_experts_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts split into groups on CUTLASS's FP8 grouped GEMM (the small-tile limit lowered so that the test's rows
    split): near reference.moe_experts_w8a8_rows (bf16 rounding of the intermediate and fast accumulation apart)."""
    if not moe.scaled_grouped_mm_device(torch.cuda.current_device()):
        pytest.skip("torch._scaled_grouped_mm has no CUTLASS FP8 kernel for this device")
    monkeypatch.delenv("PAGODA_MOE_FP8_GMM_SPLIT", raising=False)
    q_up, s_up, q_down, s_down = (_with_spare_expert(t, "cuda") for t in _fp8_weights(None))
    num_tokens = 64  # 128 pairs: 8 groups an expert with M <= 4
    x, weights, ids = (t.cuda() for t in _routed(num_tokens, torch.bfloat16, seed=5))
    monkeypatch.setattr(moe, "GMM_FP8_SMALL_TILE_M", 4)
    monkeypatch.setattr(moe, "GMM_FP8_SPLIT_MAX_M", {(EXPERTS, INTER, HIDDEN): 1 << 20})
    rows = moe.max_padded_rows(num_tokens * TOP_K, EXPERTS, moe.GMM_FP8_BLOCK_M)
    assert moe.expert_split(rows, q_up, s_up, 1 << 20) > 1, "the test's weights must split"
    got = moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, path="gmm")
    expected = ref.moe_experts_w8a8_rows(x, q_up, q_down, weights, ids, s_up, s_down)
    _assert_near_quantized(got.float(), expected.float())


def test_combine_top_k_matches_weighted_sum() -> None:
    gen = torch.Generator().manual_seed(7)
    num_tokens, top_k, num_rows = 6, 3, 25
    o = torch.randn(num_rows, HIDDEN, generator=gen).half()  # [rows, H]
    positions = torch.randperm(num_rows, generator=gen)[:num_tokens * top_k].to(torch.int32)  # [T * k]
    weights = torch.rand(num_tokens * top_k, generator=gen)  # [T * k]
    got = moe.combine_top_k(o, positions, weights, top_k)
    expected = ref.combine_top_k(o, positions, weights, top_k)  # products rounded as the Triton path stores them
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_moe_path_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """gmm only for bf16 weights on a CUTLASS-grouped-GEMM CUDA device from GMM_MIN_ROWS_PER_EXPERT pairs an expert;
    decode's largest default graph batch (256 tokens, even at 10 experts each) stays on Triton."""
    monkeypatch.setattr(moe, "cutlass_grouped_mm_device", lambda index: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    big = moe.GMM_MIN_ROWS_PER_EXPERT * 66 // 8
    assert moe.moe_path(cuda, bf16, bf16, big, 8, 66, 2048, 1408) == "gmm"
    assert moe.moe_path(cuda, bf16, bf16, big - 1, 8, 66, 2048, 1408) == "triton"
    assert moe.moe_path(cuda, bf16, bf16, 256, 10, 66, 2048, 1408) == "triton"
    assert moe.moe_path(torch.device("cpu"), bf16, bf16, big, 8, 66, 2048, 1408) == "triton"
    assert moe.moe_path(cuda, torch.float16, torch.float16, big, 8, 66, 2048, 1408) == "triton"  # torch: host sync
    assert moe.moe_path(cuda, bf16, torch.float8_e4m3fn, big, 8, 66, 2048, 1408) == "triton"
    assert moe.moe_path(cuda, bf16, bf16, big, 8, 66, 2048, 1412) == "triton"  # rows not 16-byte multiples
    monkeypatch.setattr(moe, "cutlass_grouped_mm_device", lambda index: False)
    assert moe.moe_path(cuda, bf16, bf16, big, 8, 66, 2048, 1408) == "triton"


def test_fused_experts_rejects_bad_paths() -> None:
    w_gate_up, w_down = _weights(torch.float32)
    x, weights, ids = _routed(3, torch.float32)
    with pytest.raises(ValueError, match="MoE path"):
        moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="cutlass")
    q_up, s_up, q_down, s_down = _fp8_weights(16)  # block-scaled: the Triton path's alone
    with pytest.raises(ValueError, match="FP8"):
        moe.fused_experts(x, q_up, q_down, weights, ids, s_up, s_down, 16, path="gmm")


@pytest.mark.gpu
@needs_grouped_mm
def test_gmm_path_bf16_on_gpu_captures_in_a_graph() -> None:
    """bf16 on the GPU at GMM_MIN_ROWS_PER_EXPERT pairs an expert: the default dispatch takes the gmm path where
    CUTLASS grouped GEMMs exist, it matches the Triton path, and it captures in a CUDA graph (a host sync would fail
    the capture)."""
    num_tokens = moe.GMM_MIN_ROWS_PER_EXPERT * EXPERTS // TOP_K
    w_gate_up, w_down = (w.cuda() for w in _weights(torch.bfloat16))
    x, weights, ids = (t.cuda() for t in _routed(num_tokens, torch.bfloat16, seed=3))
    cutlass = moe.cutlass_grouped_mm_device(x.device.index)
    expected_path = "gmm" if cutlass else "triton"
    assert moe.moe_path(x.device, x.dtype, x.dtype, num_tokens, TOP_K, EXPERTS, HIDDEN, INTER) == expected_path
    triton_path = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="triton")
    got = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="gmm")
    torch.testing.assert_close(got.float(), triton_path.float(), atol=2e-2, rtol=2e-2)
    if not cutlass:
        pytest.skip("torch._grouped_mm falls back to a loop over host-side offsets here: not capturable")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.fused_experts(x, w_gate_up, w_down, weights, ids, path="gmm")
    graph.replay()
    torch.testing.assert_close(captured, got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deferred_top_k_sum_summed_by_the_residual_norm(dtype: torch.dtype) -> None:
    """defer_sum on the grouped-GEMM path: the k weighted rows of each token come back as DeferredSum [k, T, H]
    (a strided view, no copy), and the residual add + norm that sums them (norm.add_rms_norm_parts) gives what the
    summed output through add_rms_norm gives; the GEMV path (its own in-kernel sum) still returns [T, H]."""
    from pagoda.kernels import norm
    from pagoda.kernels.fp8_weight_only import DeferredSum

    w_gate_up, w_down = _weights(dtype)
    x, weights, ids = _routed(24, dtype, seed=4)
    tiles = (moe.TileConfig(16, 32, 32, 1, 4, 2),) * 2
    summed = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=tiles)  # [T, H]
    deferred = moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles=tiles, defer_sum=True)
    assert isinstance(deferred, DeferredSum) and deferred.parts.shape == (TOP_K, 24, HIDDEN)
    assert deferred.parts.dtype == dtype and deferred.dtype == dtype and not deferred.parts.is_contiguous()
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(deferred.materialize(), summed, **tolerance)
    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(24, HIDDEN, generator=gen).to(dtype)
    norm_weight = torch.rand(HIDDEN, generator=gen).to(dtype) + 0.5
    normed, new_residual = norm.add_rms_norm_parts(deferred.parts, dtype, residual, norm_weight, 1e-6)
    expected_normed, expected_residual = ref.add_rms_norm(deferred.materialize(), residual, norm_weight, 1e-6)
    torch.testing.assert_close(new_residual, expected_residual, **tolerance)
    torch.testing.assert_close(normed, expected_normed, **tolerance)
    gemv = (moe.GemvConfig(16, 32, 4, 2),) * 2
    assert isinstance(moe.fused_experts(x[:2], w_gate_up, w_down, weights[:2], ids[:2], tiles=gemv, defer_sum=True),
                      torch.Tensor)
    with pytest.raises(ValueError, match="parts"):  # another dtype than the output's (nor fp32)
        norm.add_rms_norm_parts(deferred.parts.double(), dtype, residual, norm_weight, 1e-6)
