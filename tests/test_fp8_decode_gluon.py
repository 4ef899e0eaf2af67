"""The hand-pipelined fp8-cache decode kernel (kernels/fp8_decode_gluon.py) against the PyTorch reference and the
Triton decode launch it stands in for. Gluon compiles only for the GPU (Triton's interpreter does not run it), so
the comparisons are GPU tests; on the CPU the switch must fall back to the Triton launch, unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagoda.kernels import fp8_decode_gluon
from pagoda.kernels.paged_attention import AttentionConfig
from tests.test_kv_fp8 import ATOL, DEVICE, _check, _fp8_case, _run

TRITON_DECODE = AttentionConfig(fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True,
                                prefill_block_m=16, prefill_tile_n=16)


def _pipelined(num_splits: int, stages: int, tile_n: int = 64) -> tuple[AttentionConfig, AttentionConfig]:
    """(the Gluon launch, the Triton launch it replaces) with the same splits and key tiles."""
    triton_config = replace(TRITON_DECODE, num_splits=num_splits, decode_tile_n=tile_n)
    return replace(triton_config, decode_pipelined=True, decode_num_stages=stages), triton_config


def _padded(case: dict, extra_rows: int) -> dict:
    """The case with extra q rows past the last sequence (a CUDA graph's padding), which must come out zero."""
    q = case["q"]
    return {**case, "q": torch.cat([q, torch.randn(extra_rows, *q.shape[1:]).to(q.dtype)])}


def test_switch_falls_back_where_gluon_cannot_run() -> None:
    """decode_pipelined where the Gluon kernel does not apply (the CPU and Triton's interpreter, an fp32 q, the
    f16_words conversion): the Triton launch, bit for bit."""
    case = _fp8_case([1, 1, 1], [70, 5, 130], torch.float16, num_heads=8, num_kv_heads=2, head_dim=64, seed=3,
                     gaussian=True)
    for config in (TRITON_DECODE, replace(TRITON_DECODE, fp8_convert="f16_words", decode_keys_on_m=False)):
        if DEVICE == "cuda" and config.fp8_convert == "qk_fp8x2":
            continue  # the GPU takes the Gluon kernel: the tests below
        assert torch.equal(_run(case, replace(config, decode_pipelined=True)), _run(case, config))
    q = torch.empty(1, 8, 64, device=DEVICE)
    assert not fp8_decode_gluon.supports(q, 64, 4, 64, 2)  # fp32 q (and on the CPU: no GPU)
    assert not fp8_decode_gluon.supports(q.half(), 48, 4, 64, 2)  # a head_dim that is not a power of two
    assert not fp8_decode_gluon.supports(q.half(), 64, 4, 32, 2)  # key tiles below the wgmma's 64 rows
    assert not fp8_decode_gluon.supports(q.half(), 64, 4, 128, 2)  # 128-key tiles: not served
    assert not fp8_decode_gluon.supports(q.half(), 32, 4, 64, 2)  # head_dim below the PV wgmma's 64 rows


def test_a_shape_that_fails_to_compile_falls_back_once(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Gluon is experimental: where the kernel does not compile for a shape, that launch (and every later one of the
    shape) runs Triton's decode kernel, with one warning, and the output is Triton's."""
    calls = []

    class FailingKernel:
        def __getitem__(self, grid: tuple[int, int, int]):  # noqa: ANN204
            def run(*args: object, **options: object) -> None:
                calls.append(grid)
                raise RuntimeError("PassManager::run failed")
            return run

    monkeypatch.setattr(fp8_decode_gluon, "fp8_decode_kernel", FailingKernel())
    monkeypatch.setattr(fp8_decode_gluon, "on_hopper", lambda q: True)
    monkeypatch.setattr(fp8_decode_gluon, "_FAILED_SHAPES", set())
    case = _fp8_case([1, 1, 1], [70, 5, 130], torch.float16, num_heads=8, num_kv_heads=2, head_dim=64, seed=3,
                     gaussian=True)
    pipelined = replace(TRITON_DECODE, decode_pipelined=True)
    with caplog.at_level("WARNING", logger="pagoda.kernels.fp8_decode_gluon"):
        first, second = _run(case, pipelined), _run(case, pipelined)
    assert len(calls) == 1  # tried once; the second launch of the shape went straight to Triton's
    assert sum("Gluon fp8 decode kernel unavailable" in r.getMessage() for r in caplog.records) == 1
    expected = _run(case, TRITON_DECODE)
    assert torch.equal(first, expected) and torch.equal(second, expected)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_splits", "stages"), [(1, 2), (1, 3), (4, 2), (64, 2), (2, 4)])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_gluon_decode_matches_reference_and_triton(num_splits: int, stages: int, q_dtype: torch.dtype) -> None:
    """Decode rows over sequences of one key to many tiles, whole and partial, split or not (64 splits: most of them
    empty), every ring depth; padding rows past the last sequence come out zero (in the reference too)."""
    case = _padded(_fp8_case([1] * 7, [150, 7, 40, 64, 128, 1, 700], q_dtype, num_heads=8, num_kv_heads=2,
                             head_dim=128, seed=21, gaussian=True), 3)
    gluon_config, triton_config = _pipelined(num_splits, stages)
    out = _run(case, gluon_config)
    assert torch.equal(out[7:], torch.zeros_like(out[7:]))
    case_rows = {**case, "q": case["q"][:7]}
    _check(case_rows, gluon_config, ATOL[q_dtype])
    expected = _run(case, triton_config)
    torch.testing.assert_close(out, expected, rtol=0.0, atol=2 * ATOL[q_dtype] * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "tile_n"),
                         [(16, 8, 128, 16, 64), (32, 8, 128, 16, 64), (8, 8, 64, 32, 64), (32, 2, 64, 16, 64),
                          (64, 1, 64, 64, 64), (8, 2, 256, 16, 64), (9, 3, 64, 16, 64)])
def test_gluon_decode_head_layouts(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                   tile_n: int) -> None:
    """Groups of 1 to 64 query heads a kv head (qwen3-0.6b's 2, llama3-8b's 4, SmolLM2's 3; up to 8 in one packed
    score dot, more in two), head dims 64 to 256, cache blocks smaller and larger than a key tile."""
    case = _fp8_case([1] * 4, [300, 65, 1, 129], torch.bfloat16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, seed=5, gaussian=True)
    gluon_config, _ = _pipelined(1, 2, tile_n)
    _check(case, gluon_config, ATOL[torch.bfloat16])


@pytest.mark.gpu
def test_gluon_decode_rows_beside_chunks() -> None:
    """A step mixing chunks over cached context with decode rows: the decode rows go through the Gluon kernel
    (decode_fp8_convert), the chunks through the tiled launch, and both match the reference."""
    case = _fp8_case([1, 37, 1, 1, 80], [90, 200, 33, 512, 80], torch.bfloat16, num_heads=16, num_kv_heads=8,
                     head_dim=128, seed=8, gaussian=True)
    config = AttentionConfig(fp8_convert="f16_words", decode_fp8_convert="qk_fp8x2", decode_keys_on_m=True,
                             decode_lazy_sum=True, decode_pipelined=True, prefill_block_m=64, prefill_tile_n=64)
    _check(case, config, ATOL[torch.bfloat16])
