"""Weight-only FP8 (W8A16) GEMV / skinny GEMM against its PyTorch reference on random inputs, for every launch
variant the dispatch can pick (FMA rows or tensor-core tiles, split-K, per-channel or per-group scales, bias,
ragged K), and the model layer's choice between it and the W8A8 path."""

from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import Executor, Future
from typing import Any

import pytest
import torch

from pagoda.kernels import fp8_weight_only as w8
from pagoda.kernels import reference as ref

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _weights(n: int, k: int, group_size: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05  # [N, K]
    q, scale = ref.quantize_fp8_rows(w, group_size)
    return q.to(DEVICE), scale.to(DEVICE)


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs of an fp32-accumulated dot: within a few bf16 ulps of the reference."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tiles", [
    w8.GemvTiles(block_m=1, block_n=16, block_k=128),
    w8.GemvTiles(block_m=4, block_n=32, block_k=64, split_k=2),
    w8.GemvTiles(block_m=16, block_n=32, block_k=64, use_dot=True),
    w8.GemvTiles(block_m=16, block_n=16, block_k=128, split_k=4, use_dot=True),
    w8.GemvTiles(block_m=16, block_n=64, block_k=64, use_dot=True, swap_ab=True),
    w8.GemvTiles(block_m=32, block_n=32, block_k=128, split_k=2, use_dot=True, swap_ab=True),
], ids=["fma", "fma-split2", "dot", "dot-split4", "dot-swap", "dot-swap-split2"])
@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("num_rows", [1, 3])
def test_weight_only_kernel_matches_reference(tiles: w8.GemvTiles, group_size: int | None, num_rows: int) -> None:
    n, k = 48, 512  # N not a multiple of the tile: masked columns
    weight, scale = _weights(n, k, group_size, seed=num_rows)
    x = torch.randn(num_rows, k, device=DEVICE).bfloat16()  # [M, K]
    bias = torch.randn(n, device=DEVICE).bfloat16()
    out = w8.fp8_weight_only_linear(x, weight, scale, group_size, bias, tiles=tiles)
    _close(out, ref.fp8_weight_only_linear(x, weight, scale, group_size, bias))


def test_weight_only_kernel_ragged_k_and_batch_dims() -> None:
    """K not a multiple of the tile or the split (the masked tail), x with leading dims, fp16, no bias."""
    n, k = 40, 200
    weight, scale = _weights(n, k, None, seed=7)
    tile_sets = (w8.GemvTiles(block_m=8, block_n=16, block_k=64, split_k=2),
                 w8.GemvTiles(block_m=16, block_n=16, block_k=64, use_dot=True))
    for dtype, tiles in itertools.product((torch.float16, torch.float32), tile_sets):
        x = torch.randn(2, 3, k, device=DEVICE).to(dtype)  # [2, 3, K]
        out = w8.fp8_weight_only_linear(x, weight, scale, None, tiles=tiles)
        assert out.shape == (2, 3, n)
        _close(out, ref.fp8_weight_only_linear(x, weight, scale, None))


def test_weight_only_default_tiles_every_bucket() -> None:
    """The default dispatch (no tuned table on CPU) for each M bucket, on a shape needing split-K."""
    n, k = 32, 1024
    weight, scale = _weights(n, k, 128, seed=3)
    for num_rows in (1, 2, 5, 16, 32):
        tiles = w8.default_tiles(num_rows, n, k)
        assert tiles.split_k > 1, "32 columns are too few programs: the default splits K"
        assert w8.default_tiles(num_rows, n, 96).block_k == 128, "tile sizes are powers of two for any K"
        x = torch.randn(num_rows, k, device=DEVICE).bfloat16()
        _close(w8.fp8_weight_only_linear(x, weight, scale, 128),
               ref.fp8_weight_only_linear(x, weight, scale, 128))


def test_weight_only_rejects_bad_input() -> None:
    weight, scale = _weights(32, 256, None, seed=1)
    x = torch.randn(2, 256, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="at most"):
        w8.fp8_weight_only_linear(torch.randn(w8.MAX_ROWS + 1, 256, device=DEVICE).bfloat16(), weight, scale, None)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        w8.fp8_weight_only_linear(x.double(), weight, scale, None)
    with pytest.raises(ValueError, match="weight_scale"):
        w8.fp8_weight_only_linear(x, weight, scale[:, :0], None)
    with pytest.raises(ValueError, match="groups"):  # block_k larger than the scale group
        w8.fp8_weight_only_linear(x, *_weights(32, 256, 64, seed=2), 64, tiles=w8.GemvTiles(block_k=128))
    with pytest.raises(ValueError, match="power of two"):
        w8.fp8_weight_only_linear(x, weight, scale, None, tiles=w8.GemvTiles(block_k=96))
    with pytest.raises(ValueError, match="block_m >= 16"):
        w8.fp8_weight_only_linear(x, weight, scale, None, tiles=w8.GemvTiles(block_m=4, use_dot=True))
    with pytest.raises(ValueError, match="swap_ab"):
        w8.fp8_weight_only_linear(x, weight, scale, None, tiles=w8.GemvTiles(block_m=1, swap_ab=True))


def test_tuned_table_round_trips_and_picks_by_bucket(tmp_path, monkeypatch) -> None:
    """A table written as bench/fp8_tune writes it is read back per (N, K, M bucket); other shapes get defaults."""
    import json

    tiles = w8.GemvTiles(block_m=2, block_n=64, block_k=256, split_k=2, num_warps=8, num_stages=3)
    (tmp_path / w8.config_name("Test_GPU")).write_text(json.dumps({"4096,4096,2": w8.tiles_to_json(tiles),
                                                                      "4096,4096,32": {"w8a8": True}}))
    monkeypatch.setattr(w8, "CONFIG_DIR", tmp_path)
    w8.clear_tables()
    try:
        table = w8.tuned_table("Test GPU")
        assert table == {(4096, 4096, 2): tiles}
        assert w8.w8a8_buckets("Test GPU") == {(4096, 4096, 32)}
        assert w8.m_bucket(2) == 2 and w8.m_bucket(3) == 4 and w8.m_bucket(17) == 32 and w8.m_bucket(200) == 256
    finally:
        w8.clear_tables()


def test_layers_take_weight_only_for_few_rows_and_w8a8_beyond() -> None:
    """quantized_linear (every FP8 linear of the dense, MoE and DeepSeek layers) routes by row count."""
    import dataclasses

    from pagoda.services.worker.models.base import Fp8Weights, quantized_linear, reference_ops

    calls: list[str] = []

    def spy(name: str, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    ops = reference_ops()
    ops = dataclasses.replace(ops, fp8_weight_only=spy("w8a16", ops.fp8_weight_only),
                              fp8_linear=spy("w8a8", ops.fp8_linear))
    weight, scale = _weights(16, 64, None, seed=5)
    for rows, path in ((1, "w8a16"), (w8.DEFAULT_MAX_ROWS, "w8a16"), (w8.DEFAULT_MAX_ROWS + 1, "w8a8")):
        x = torch.randn(rows, 64, device=DEVICE).bfloat16()
        out = quantized_linear(x, weight, scale, Fp8Weights(), None, ops)
        assert calls[-1] == path
        expected = (ref.fp8_weight_only_linear if path == "w8a16" else ref.fp8_linear)(x, weight, scale, None)
        _close(out, expected)


@pytest.mark.parametrize("tiles", [
    w8.GemvTiles(block_m=1, block_n=16, block_k=128, late_reduce=True),
    w8.GemvTiles(block_m=1, block_n=8, block_k=64, split_k=2, late_reduce=True),
], ids=["late", "late-split2"])
@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("k", [512, 200])
def test_late_reduce_tiles_match_reference(tiles: w8.GemvTiles, group_size: int | None, k: int) -> None:
    """One-row FMA tiles that reduce over K once at the end: the reference's product, for whole and ragged K, with
    channel and group scales."""
    if group_size is not None and k % group_size:
        pytest.skip("group scales need whole groups per split")
    n = 40
    weight, scale = _weights(n, k, group_size, seed=k)
    x = torch.randn(1, k, device=DEVICE).bfloat16()  # [1, K]
    out = w8.fp8_weight_only_linear(x, weight, scale, group_size, tiles=tiles)
    _close(out, ref.fp8_weight_only_linear(x, weight, scale, group_size))
    with pytest.raises(ValueError, match="late_reduce"):
        w8.fp8_weight_only_linear(torch.cat([x, x]), weight, scale, group_size,
                                  tiles=dataclasses.replace(tiles, block_m=2))


@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("num_rows", [1, 5])
def test_split_k_partials_summed_by_the_norm_equal_the_separate_kernels(num_rows: int, group_size: int | None) -> None:
    """A deferred split-K output is the GEMM's own partial sums: materialised it equals the summed output, and
    add_rms_norm_parts equals add_rms_norm of that output bit for bit. Unsplit tiles, a bias or leading batch dims
    give a plain tensor."""
    from pagoda.kernels.norm import add_rms_norm, add_rms_norm_parts

    n, k = 64, 512
    weight, scale = _weights(n, k, group_size, seed=30 + num_rows)
    x = torch.randn(num_rows, k, device=DEVICE).bfloat16()  # [M, K]
    residual = torch.randn(num_rows, n, device=DEVICE).bfloat16()  # [M, N]
    norm_w = (1 + 0.1 * torch.randn(n)).to(DEVICE).bfloat16()
    split = w8.GemvTiles(block_m=1 if num_rows == 1 else 8, block_n=16, block_k=128, split_k=4)
    deferred = w8.fp8_weight_only_deferred(x, weight, scale, group_size, tiles=split)
    assert isinstance(deferred, w8.DeferredSum) and deferred.parts.shape == (4, num_rows, n)
    summed = w8.fp8_weight_only_linear(x, weight, scale, group_size, tiles=split)
    assert torch.equal(deferred.materialize(), summed)
    for fused, separate in zip(add_rms_norm_parts(deferred.parts, x.dtype, residual, norm_w, 1e-6),
                               add_rms_norm(summed, residual, norm_w, 1e-6), strict=True):
        assert torch.equal(fused, separate)
    _close(summed, ref.fp8_weight_only_linear(x, weight, scale, group_size))
    bias = torch.randn(n, device=DEVICE).bfloat16()
    unsplit = dataclasses.replace(split, split_k=1)
    for plain in (w8.fp8_weight_only_deferred(x, weight, scale, group_size, tiles=unsplit),
                  w8.fp8_weight_only_deferred(x, weight, scale, group_size, bias, tiles=split),
                  w8.fp8_weight_only_deferred(x[None], weight, scale, group_size, tiles=split)):
        assert isinstance(plain, torch.Tensor)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_parts(deferred.parts, x.dtype, residual[:, :8], norm_w, 1e-6)


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_model_with_split_k_sums_in_the_norm_equals_separate_kernels(shape: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole FP8 model through the Triton ops with split-K tiles forced on every weight-only GEMV: leaving the
    sums to their consumers (the default: the next norm for o and down, the sparse block's norm for o in an MoE
    family, qkv prep for qkv) gives the hidden states of PAGODA_FUSE_SPLIT_K=0 (the separate sum kernel) exactly,
    through prefill, decode and the final norm. Block scales (groups of 32, one per split); channel scales take the
    same path (the kernel-level test above)."""
    from pagoda.services.worker.models import CausalLM, Fp8Weights, triton_ops
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    def split_tiles(num_rows: int, n: int, k: int, group_size: int | None, device: torch.device) -> w8.GemvTiles:
        return w8.GemvTiles(block_m=min(4, 1 << (num_rows - 1).bit_length()), block_n=16, block_k=32, split_k=2)

    monkeypatch.setattr(w8, "pick_tiles", split_tiles)
    summed_widths: list[int] = []  # N of every split-K sum kernel launched
    launch_sum = w8._launch_split_k_sum
    monkeypatch.setattr(w8, "_launch_split_k_sum",
                        lambda part, out, bias: (summed_widths.append(part.shape[2]), launch_sum(part, out, bias)))
    arch, dev = SHAPES[shape], torch.device(DEVICE)
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=64, ops=triton_ops(),
                     fp8=Fp8Weights(32))  # 2 splits of 32: whole scale groups
    load_model(model, None, "dummy", seed=5)
    results, sums = [], []
    for fuse in ("1", "norms", "0"):
        monkeypatch.setenv("PAGODA_FUSE_SPLIT_K", fuse)
        results.append(_prefill_then_decode(model, arch, dev))
        sums.append(set(summed_widths))
        summed_widths.clear()
    for fused, norms_only, separate in zip(*results, strict=True):
        assert torch.equal(fused, separate) and torch.equal(norms_only, separate)
    qkv_width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    assert {qkv_width, arch.hidden_size} <= sums[2]  # the separate kernels sum qkv, o and down
    assert qkv_width in sums[1] and arch.hidden_size not in sums[1]  # "norms": the norms sum o and down
    assert not {qkv_width, arch.hidden_size} & sums[0]  # qkv prep and the norms sum them all


def test_weight_only_partials_feeding_a_w8a8_layer_are_quantized_in_the_norm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dispatch that runs o and down weight-only with split-K (their sums left to the next norm) and qkv and
    gate_up W8A8, as the H200 table does at 32-64 rows: the norm between them sums the partials and quantizes for
    the W8A8 GEMM in one pass, so no quantize kernel runs, and the hidden states equal those of the separate sum
    kernel (PAGODA_FUSE_SPLIT_K=0) bit for bit, through prefill, decode and the final norm."""
    import dataclasses

    from pagoda.kernels import fp8
    from pagoda.services.worker.models import CausalLM, Fp8Weights, triton_ops
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    arch, dev = SHAPES["tiny"], torch.device(DEVICE)

    def split_tiles(num_rows: int, n: int, k: int, group_size: int | None, device: torch.device) -> w8.GemvTiles:
        return w8.GemvTiles(block_m=min(4, 1 << (num_rows - 1).bit_length()), block_n=16, block_k=32, split_k=2)

    def hidden_wide_only(num_rows: int, n: int, k: int, device: torch.device) -> bool:
        return n == arch.hidden_size  # o and down weight-only; qkv and gate_up W8A8

    quantize_calls: list[int] = []
    plain_quantize = fp8.quantize_fp8_rows

    def counting_quantize(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        quantize_calls.append(x.shape[0])
        return plain_quantize(x, group_size)

    monkeypatch.setattr(w8, "pick_tiles", split_tiles)
    monkeypatch.setattr(fp8, "quantize_fp8_rows", counting_quantize)
    ops = dataclasses.replace(triton_ops(), prefers_weight_only=hidden_wide_only)
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=64, ops=ops, fp8=Fp8Weights(None))
    load_model(model, None, "dummy", seed=6)
    results = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("PAGODA_FUSE_SPLIT_K", fuse)
        results.append(_prefill_then_decode(model, arch, dev))
    assert quantize_calls == []
    for fused, separate in zip(*results, strict=True):
        assert torch.equal(fused, separate)


def _prefill_then_decode(model: torch.nn.Module, arch: Any, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of two prompts (3 and 2 tokens, 5 rows) then one decode token each, on fresh bf16 caches."""
    from pagoda.bench.decode_profile import make_batch

    prefill_meta, prefill_pos, num_blocks = make_batch([3, 2], [3, 2], dev)
    decode_meta, decode_pos, _ = make_batch([1, 1], [4, 3], dev)
    ids = torch.tensor([5, 9, 11, 7, 8], device=dev)
    caches = [tuple(torch.zeros(num_blocks, 16, arch.num_kv_heads, arch.head_dim, device=dev,
                                dtype=torch.bfloat16) for _ in range(2)) for _ in range(arch.num_layers)]
    with torch.inference_mode():
        prefill = model(ids, prefill_pos, caches, prefill_meta)  # [5, H]
        decode = model(ids[[2, 4]], decode_pos, caches, decode_meta)  # [2, H]
    return prefill, decode


@pytest.mark.parametrize("tiles", [
    w8.GemvTiles(block_m=1, block_n=16, block_k=128, split_k=2),
    w8.GemvTiles(block_m=1, block_n=16, block_k=128, late_reduce=True),
    w8.GemvTiles(block_m=16, block_n=16, block_k=64, split_k=2, use_dot=True),
    w8.GemvTiles(block_m=16, block_n=64, block_k=64, use_dot=True, swap_ab=True),
], ids=["fma-split2", "fma-late", "dot-split2", "dot-swap"])
@pytest.mark.parametrize("group_size", [None, 128])
def test_gated_down_projection_equals_silu_then_gemv(tiles: w8.GemvTiles, group_size: int | None) -> None:
    """gated=True reads [gate ‖ up] and multiplies silu(gate) * up itself: the same bits as silu_and_mul followed by
    the plain GEMV, split-K partials included; a K that does not fill the tiles masks the tail of both halves."""
    from pagoda.kernels.activation import silu_and_mul

    for k in (256, 200):
        if group_size and k % (group_size * tiles.split_k):
            continue  # scale groups must tile the splits
        n = 40
        weight, scale = _weights(n, k, group_size, seed=k)
        gate_up = (2 * torch.randn(3 if tiles.block_m > 1 else 1, 2 * k, device=DEVICE)).bfloat16()  # [M, 2K]
        fused = w8.fp8_weight_only_deferred(gate_up, weight, scale, group_size, tiles=tiles, gated=True)
        plain = w8.fp8_weight_only_deferred(silu_and_mul(gate_up), weight, scale, group_size, tiles=tiles)
        assert type(fused) is type(plain)
        if isinstance(fused, w8.DeferredSum):
            assert isinstance(plain, w8.DeferredSum) and torch.equal(fused.parts, plain.parts)
        else:
            assert torch.equal(fused, plain)
    with pytest.raises(ValueError, match="gate"):
        w8.fp8_weight_only_deferred(gate_up[:, :k], weight, scale, group_size, tiles=tiles, gated=True)


def test_model_with_silu_fused_into_down_equals_separate_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_FUSE_SILU_GEMV=1: the FP8 model's weight-only down projections take [gate ‖ up] and the hidden
    states equal the default's (silu_and_mul, then the GEMV) exactly, through prefill and decode; the silu kernel is
    not launched for those layers."""
    from pagoda.kernels import activation
    from pagoda.services.worker.models import CausalLM, Fp8Weights, triton_ops
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    arch, dev = SHAPES["tiny"], torch.device(DEVICE)
    silu_calls: list[int] = []
    ops = triton_ops()
    ops = dataclasses.replace(ops, silu_and_mul=lambda x: silu_calls.append(x.shape[0]) or activation.silu_and_mul(x))
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=64, ops=ops, fp8=Fp8Weights(32))
    load_model(model, None, "dummy", seed=6)
    results, launches = [], []
    for fuse in ("1", "0"):
        monkeypatch.setenv("PAGODA_FUSE_SILU_GEMV", fuse)
        silu_calls.clear()
        results.append(_prefill_then_decode(model, arch, dev))
        launches.append(len(silu_calls))
    for fused, separate in zip(*results, strict=True):
        assert torch.equal(fused, separate)
    assert launches == [0, 2 * arch.num_layers], "fused: no silu launch on the weight-only path"


ACT_FP8_TILES = [
    w8.GemvTiles(block_m=16, block_n=32, block_k=64, use_dot=True, act_fp8=True),
    w8.GemvTiles(block_m=32, block_n=16, block_k=128, split_k=2, use_dot=True, act_fp8=True),
    w8.GemvTiles(block_m=16, block_n=64, block_k=64, use_dot=True, swap_ab=True, act_fp8=True),
    w8.GemvTiles(block_m=32, block_n=64, block_k=128, split_k=2, use_dot=True, swap_ab=True, act_fp8=True),
]
ACT_FP8_IDS = ["dot", "dot-split2", "dot-swap", "dot-swap-split2"]


@pytest.mark.parametrize("tiles", ACT_FP8_TILES, ids=ACT_FP8_IDS)
@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("num_rows", [3, 20])
def test_act_fp8_tiles_quantize_each_activation_tile(tiles: w8.GemvTiles, group_size: int | None,
                                                     num_rows: int) -> None:
    """act_fp8 tiles equal W8A8 with the activations quantized per row and BLOCK_K columns (the tile they load),
    not the unquantized W8A16 product: each row's tiles get their own scales (rows and tiles of very different
    magnitude below)."""
    n, k = 48, 512
    weight, scale = _weights(n, k, group_size, seed=num_rows)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, k, generator=gen).to(DEVICE)  # [M, K]
    x[:, : tiles.block_k] *= 1e-2  # the first K tile of every row far below the rest
    x[0] *= 50.0
    x = x.bfloat16()
    bias = torch.randn(n, generator=gen).to(DEVICE).bfloat16()
    out = w8.fp8_weight_only_linear(x, weight, scale, group_size, bias, tiles=tiles)
    expected = ref.fp8_act_tile_linear(x, weight, scale, group_size, tiles.block_k, bias)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    # mean errors relative to each row's largest output: the bf16 rounding of the output (~2^-9) against the
    # quantization noise of the activations (~2^-5)
    err_to_tiles = _mean_row_error(out, expected)
    assert err_to_tiles < 0.5 * _mean_row_error(out, ref.fp8_weight_only_linear(x, weight, scale, group_size, bias)), \
        "the activations were quantized"
    per_row = ref.fp8_linear(x, weight, scale, group_size, bias)  # one activation scale a row (or scale group)
    if group_size != tiles.block_k:
        assert err_to_tiles < 0.5 * _mean_row_error(out, per_row), "with scales per row and K tile"


def _mean_row_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    row_max = expected.float().abs().amax(-1, keepdim=True).clamp_min(1e-6)
    return ((out.float() - expected.float()).abs() / row_max).mean().item()


@pytest.mark.parametrize("tiles", ACT_FP8_TILES[1:3], ids=ACT_FP8_IDS[1:3])
def test_act_fp8_tiles_ragged_k_gated_and_fp32(tiles: w8.GemvTiles) -> None:
    """A K that does not fill the tiles (the masked tail quantizes as zeros); the gated down projection quantizes
    silu(gate) * up, the same bits as silu_and_mul and then the plain act_fp8 GEMV; fp32 activations."""
    from pagoda.kernels.activation import silu_and_mul

    n, k = 40, 200
    weight, scale = _weights(n, k, None, seed=11)
    gen = torch.Generator().manual_seed(12)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 9, k, generator=gen).to(DEVICE, dtype)  # [2, 9, K]
        out = w8.fp8_weight_only_linear(x, weight, scale, None, tiles=tiles)
        expected = ref.fp8_act_tile_linear(x, weight, scale, None, tiles.block_k)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    gate_up = (2 * torch.randn(5, 2 * k, generator=gen)).to(DEVICE).bfloat16()  # [M, 2K]
    fused = w8.fp8_weight_only_deferred(gate_up, weight, scale, None, tiles=tiles, gated=True)
    plain = w8.fp8_weight_only_deferred(silu_and_mul(gate_up), weight, scale, None, tiles=tiles)
    if isinstance(fused, w8.DeferredSum):
        assert isinstance(plain, w8.DeferredSum) and torch.equal(fused.parts, plain.parts)
    else:
        assert isinstance(plain, torch.Tensor) and torch.equal(fused, plain)


def test_act_fp8_tiles_refuse_what_they_cannot_run() -> None:
    weight, scale = _weights(32, 256, None, seed=1)
    x = torch.randn(2, 256, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="act_fp8"):  # FMA rows have no fp8 tensor-core dot
        w8.fp8_weight_only_linear(x, weight, scale, None, tiles=w8.GemvTiles(block_m=2, act_fp8=True))
    with pytest.raises(ValueError, match="act_fp8"):  # below the fp8 MMA's K of 32
        w8.fp8_weight_only_linear(x, weight, scale, None,
                                  tiles=w8.GemvTiles(block_m=16, block_k=16, use_dot=True, act_fp8=True))
    dense = torch.randn(32, 256, device=DEVICE).bfloat16()  # 16-bit weights take the same kernel, never these tiles
    with pytest.raises(ValueError, match="act_fp8"):
        w8.launch_gemv(x, dense, None, None, None, w8.GemvTiles(block_m=16, block_k=64, use_dot=True, act_fp8=True))


def test_tuner_candidates_are_tiles_the_kernel_takes() -> None:
    """Every tile set bench/fp8_tune.py times (each pool, each M bucket) passes the kernel's checks at llama3-8b's
    row lengths, with per-channel and 128-wide group scales where its K steps fit them."""
    from pagoda.bench import fp8_tune

    for pool, bucket in itertools.product(fp8_tune.POOLS.values(), w8.M_BUCKETS):
        for tiles in pool(bucket):
            for k in (4096, 14336):
                w8._check_tiles(tiles, k, None)
                assert tiles.block_m >= min(bucket, 16) or not tiles.use_dot
    for bucket in (1, 16):  # rows padded to 16 on the dot's N side
        act = fp8_tune.act_fp8_candidates(bucket)
        assert act and all(tiles.act_fp8 and tiles.swap_ab and tiles.block_m == 16 for tiles in act)
        assert set(act) <= set(fp8_tune.candidates(bucket))


class _InlineExecutor(Executor):
    """Runs each job as it is submitted (the interpreter's patches live in this process only)."""

    def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def test_tuner_precompiles_its_candidates_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_tune's precompile launches each candidate once (through the interpreter here; in spawned processes on
    the GPU) at the shape it tunes, split into `jobs` parts; a tile set the kernel refuses is skipped, not fatal."""
    from pagoda.bench import fp8_tune

    fits = w8.GemvTiles(block_m=1, block_n=16, block_k=64, split_k=1)
    refused = w8.GemvTiles(block_m=1, block_n=16, block_k=64, use_dot=True)  # tensor cores need 16 rows
    assert fp8_tune.compile_tiles(32, 128, 1, [w8.tiles_to_json(t) for t in (fits, refused)]) == 1
    monkeypatch.setitem(fp8_tune.POOLS, "all", lambda bucket: [fits, refused, fits])
    jobs: list[tuple[int, list[dict]]] = []
    compile_tiles = fp8_tune.compile_tiles
    monkeypatch.setattr(fp8_tune, "compile_tiles", lambda *args: (jobs.append(args[2:]), compile_tiles(*args))[1])
    assert fp8_tune.precompile(32, 128, (1,), "all", 2, _InlineExecutor()) == 2  # fits, twice
    assert sorted((bucket, len(tiles)) for bucket, tiles in jobs) == [(1, 1), (1, 2)]  # [fits, fits], [refused]


@pytest.mark.parametrize("weight_only", [True, False])
@pytest.mark.parametrize("name", ["o", "down"])
def test_sweep_pairs_o_and_down_with_the_norm_as_the_model_runs_them(name: str, weight_only: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_tune's with-norm pair (timed on the GPU) computes the layer plus the residual add + RMSNorm after it:
    the bf16 pair and the FP8 dispatch's pair (split-K partials summed by the norm where weight-only, W8A8
    otherwise) give the same normed rows within FP8's error. Timing replaced by one call of each op here."""
    from pagoda.bench import fp8_tune

    outputs: list[torch.Tensor] = []

    def run_once(op: Any, x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor] | None) -> float:
        normed, _ = op(x, weights[0]) if scales is None else op(x, weights[0], scales[0])
        outputs.append(normed)
        return 1.0

    monkeypatch.setattr(fp8_tune, "rotating_us", run_once)
    monkeypatch.setattr(w8, "prefers_weight_only", lambda *args: weight_only)
    monkeypatch.setattr(w8, "pick_tiles", lambda *args: w8.GemvTiles(block_m=4, block_n=16, block_k=32, split_k=2))
    n, k = 48, 64
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).bfloat16()  # [N, K]: y outweighs residual
    w_q, w_s = ref.quantize_fp8_rows(weight)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).bfloat16()  # [M, K]
    assert fp8_tune.with_norm_us(name, x, [weight], [w_q], [w_s]) == (1.0, 1.0)
    bf16_normed, fp8_normed = outputs
    assert bf16_normed.shape == fp8_normed.shape == (3, n)
    assert torch.nn.functional.cosine_similarity(bf16_normed.float(), fp8_normed.float(), dim=1).min() > 0.99


@pytest.mark.parametrize("name", ["qkv", "o"])
def test_tuner_times_o_and_down_with_the_norm_after_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tune_shape (timed on the GPU; here each op called once, its "time" the count of norms in it) times o's
    candidates and its W8A8 path with the residual norm after them, a split tile's partials going to that norm
    (no sum kernel), and qkv's without one; the table entry is the candidate it timed best."""
    from pagoda.bench import fp8_tune
    from pagoda.kernels import norm

    split = w8.GemvTiles(block_m=1, block_n=16, block_k=32, split_k=2)
    whole = w8.GemvTiles(block_m=1, block_n=16, block_k=64)
    monkeypatch.setitem(fp8_tune.POOLS, "all", lambda bucket: [split, whole])
    calls: list[str] = []
    for op in ("add_rms_norm", "add_rms_norm_parts"):
        plain = getattr(norm, op)
        monkeypatch.setattr(norm, op, lambda *args, _op=op, _plain=plain: (calls.append(_op), _plain(*args))[1])
    launch_sum = w8._launch_split_k_sum
    monkeypatch.setattr(w8, "_launch_split_k_sum", lambda *args: (calls.append("sum"), launch_sum(*args))[1])
    timed: list[list[str]] = []

    def run_once(op: Any, x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> float:
        calls.clear()
        op(x, weights[0], scales[0])
        timed.append(list(calls))
        return float(len(timed))  # the first timed candidate is the fastest

    monkeypatch.setattr(fp8_tune, "rotating_us", run_once)
    n, k = 32, 64
    w_q, w_s = ref.quantize_fp8_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(5)))
    result = fp8_tune.tune_shape(name, n, k, [w_q], [w_s], (1,), device="cpu")
    if name == "o":
        assert timed == [["add_rms_norm_parts"], ["add_rms_norm"], ["add_rms_norm"]]  # split, whole, W8A8
    else:
        assert timed == [["sum"], [], []]
    assert result[1]["tiles"] == w8.tiles_to_json(split) and result[1]["choice"] == "w8a16"
