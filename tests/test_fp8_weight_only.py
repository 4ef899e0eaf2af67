"""Weight-only FP8 (W8A16) GEMV / skinny GEMM against its PyTorch reference on random inputs, for every launch
variant the dispatch can pick (FMA rows or tensor-core tiles, split-K, per-channel or per-group scales, bias,
ragged K), and the model layer's choice between it and the W8A8 path."""

from __future__ import annotations

import itertools

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
], ids=["fma", "fma-split2", "dot", "dot-split4"])
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
