"""Paged attention that also quantizes its output for the W8A8 o projection (quant_out, PAGODA_ATTN_QUANT_OUT=1):
the last program to finish a token's rows writes them as e4m3 with one scale per token. The codes and scales must be
exactly what quantizing the returned output separately gives, for every launch that writes rows (decode programs,
the padding program, query tiles, the split reduce), and the counts must be back at zero after each launch."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch

from pagoda.kernels import fp8
from pagoda.kernels import paged_attention as attention
from pagoda.kernels import reference as ref
from tests.test_kernels import SMALL_TILES, AttentionCase, make_paged_batch, reference_attention, small_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    # decode rows, chunks with and without cached prefixes, a 1-token sequence; padding rows after them
    "mixed": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), pad_tokens=2, config=SMALL_TILES),
    # decode only, with CUDA-graph filler sequences and padding rows (the padding program's rows)
    "decode": AttentionCase((1, 1, 1), (5, 40, 129), num_pad_seqs=2, pad_tokens=3, config=SMALL_TILES),
    # split-KV decode: the reduce launch quantizes, keyed by token
    "decode-split": AttentionCase((1, 1, 1), (5, 40, 129), num_pad_seqs=1, pad_tokens=1, config=small_tiles(4)),
    # a chunk step with splits (the tiled launch writes partials too)
    "mixed-split": AttentionCase((1, 7, 1), (33, 20, 64), config=small_tiles(2)),
    # G = 3, head_dim 24 (padded), 8-token blocks: rows of 6 x 24 = 144 values
    "gqa3-d24": AttentionCase((3, 1, 12), (30, 7, 12), num_heads=6, num_kv_heads=2, head_dim=24, block_size=8,
                              config=SMALL_TILES),
}


def _run(case: AttentionCase, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, codes, scales) of one launch with quant_out; out checked against the attention reference."""
    batch = make_paged_batch(case, dtype, DEVICE)
    scale = case.head_dim ** -0.5
    num_tokens = batch.q.shape[0]
    codes = torch.full((num_tokens, case.num_heads * case.head_dim), float("nan"), device=DEVICE).to(fp8.FP8_DTYPE)
    scales = torch.full((num_tokens, 1), float("nan"), device=DEVICE)
    max_query_len = max(case.query_lens + ((1,) if case.num_pad_seqs else ()))
    out = attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, max_query_len, max(case.seq_lens), scale,
                                    config=case.config, quant_out=(codes, scales))
    real = batch.num_real_tokens
    torch.testing.assert_close(out[:real].float(), reference_attention(batch, case, scale), atol=4e-3, rtol=0)
    return out, codes, scales


def _assert_quantized(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """codes / scales are the per-token quantization of out's rows (the reference's): the scales exactly; the codes,
    computed as x times the scale's inverse, at most one e4m3 step from x / scale and rarely off at all. A code never
    written stays NaN and fails."""
    expected_codes, expected_scales = ref.quantize_fp8_rows(out.reshape(out.shape[0], -1))
    assert torch.equal(scales, expected_scales), "per-token scales differ from quantizing the output"
    got, expected = codes.float(), expected_codes.float()
    assert not got.isnan().any(), "codes left unwritten"
    step = torch.where(expected.abs() < 2.0 ** -6, 2.0 ** -9, expected.abs() / 8)  # one e4m3 step (at most)
    assert ((got - expected).abs() <= step).all(), "a code more than one e4m3 step from x / scale"
    assert (got != expected).float().mean() < 0.01, "codes often differ from x / scale"


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Fresh random inputs for every case, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> dict[torch.device, torch.Tensor]:
    counters: dict[torch.device, torch.Tensor] = {}
    monkeypatch.setattr(attention, "_QUANT_COUNTERS", counters)
    return counters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_output_quantized_per_token(name: str, dtype: torch.dtype,
                                              fresh_counters: dict[torch.device, torch.Tensor]) -> None:
    case = CASES[name]
    for _ in range(2):  # the counts a launch leaves serve the next one
        out, codes, scales = _run(case, dtype)
        _assert_quantized(out, codes, scales)
        counters = next(iter(fresh_counters.values()))
        assert int(counters.abs().sum()) == 0, "a launch left counts behind"


def test_quantized_rows_longer_than_a_tile(monkeypatch: pytest.MonkeyPatch,
                                           fresh_counters: dict[torch.device, torch.Tensor]) -> None:
    """Rows of 4 x 32 values over 32-value tiles: the two-pass quantization (amax, then codes)."""
    monkeypatch.setattr(attention, "_QUANT_TILE", 32)
    out, codes, scales = _run(CASES["mixed"], torch.float16)
    _assert_quantized(out, codes, scales)


def test_quantized_without_fold_and_past_the_counters(monkeypatch: pytest.MonkeyPatch,
                                                      fresh_counters: dict[torch.device, torch.Tensor]) -> None:
    """With PAGODA_ATTN_FOLD_REDUCE=1 a quantizing split launch keeps its reduce (which quantizes); a launch with
    more keys than the counters hold quantizes in a launch of its own. Same codes either way."""
    monkeypatch.setenv("PAGODA_ATTN_FOLD_REDUCE", "1")
    out, codes, scales = _run(CASES["decode-split"], torch.float16)
    _assert_quantized(out, codes, scales)
    monkeypatch.setattr(attention, "QUANT_COUNTERS", 2)
    out, codes, scales = _run(CASES["mixed"], torch.float16)
    _assert_quantized(out, codes, scales)


def test_fp8_cache_output_quantized(fresh_counters: dict[torch.device, torch.Tensor]) -> None:
    """An fp8 cache (the Triton decode and chunk launches' conversion paths): same contract."""
    case = CASES["mixed"]
    batch = make_paged_batch(case, torch.float16, DEVICE)
    k_scale = torch.tensor([0.05], device=DEVICE)
    v_scale = torch.tensor([0.04], device=DEVICE)
    k_cache = (batch.k_cache.float().nan_to_num() / k_scale).to(fp8.FP8_DTYPE)
    v_cache = (batch.v_cache.float().nan_to_num() / v_scale).to(fp8.FP8_DTYPE)
    num_tokens = batch.q.shape[0]
    codes = torch.empty((num_tokens, case.num_heads * case.head_dim), dtype=fp8.FP8_DTYPE, device=DEVICE)
    scales = torch.empty((num_tokens, 1), device=DEVICE)
    config = replace(SMALL_TILES, fp8_convert="f16")
    out = attention.paged_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, max(case.query_lens), max(case.seq_lens),
                                    case.head_dim ** -0.5, config=config, k_scale=k_scale, v_scale=v_scale,
                                    quant_out=(codes, scales))
    _assert_quantized(out, codes, scales)


def test_quant_out_shapes_checked() -> None:
    case = CASES["decode"]
    batch = make_paged_batch(case, torch.float16, DEVICE)
    num_tokens = batch.q.shape[0]
    wrong = torch.empty((num_tokens, 7), dtype=fp8.FP8_DTYPE, device=DEVICE)
    scales = torch.empty((num_tokens, 1), device=DEVICE)
    with pytest.raises(ValueError, match="quant_out must be e4m3"):
        attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, 1, max(case.seq_lens), 0.1, quant_out=(wrong, scales))


def test_model_with_quantizing_attention_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny with FP8 weights on the Triton ops, every FP8 GEMM W8A8 (decode rows too): with PAGODA_ATTN_QUANT_OUT=1
    the o projection reads attention's own codes and no quantize launch runs (the norm and SiLU kernels quantize
    the other GEMMs' inputs); tokens are those of the separate quantize launch, logits within a code's step."""
    from pagoda.kernels import fp8_weight_only
    from tests.test_model_kernels import _run as run_model

    monkeypatch.setattr(fp8_weight_only, "DEFAULT_MAX_ROWS", 0)
    launches: list[tuple[int, ...]] = []
    kernel = fp8._quantize_rows_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fp8, "_quantize_rows_kernel", Spy())
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (30, 5, 12)]
    monkeypatch.delenv("PAGODA_ATTN_QUANT_OUT", raising=False)
    plain_tokens, plain_logits = run_model("triton", "tiny", prompts, 24, quantization="fp8")
    assert launches, "the o projection quantizes in its own launch by default"
    launches.clear()
    monkeypatch.setenv("PAGODA_ATTN_QUANT_OUT", "1")
    fused_tokens, fused_logits = run_model("triton", "tiny", prompts, 24, quantization="fp8")
    assert not launches, f"{len(launches)} quantize launches left with PAGODA_ATTN_QUANT_OUT=1"
    assert fused_tokens == plain_tokens
    for ours, expected in zip(fused_logits, plain_logits, strict=True):  # a code may be one e4m3 step apart
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=2e-3)
