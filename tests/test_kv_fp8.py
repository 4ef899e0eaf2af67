"""Paged attention over an fp8 (e4m3) KV cache: each conversion path and tile size against the PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from pagoda.kernels import reference as ref
from pagoda.kernels.paged_attention import (
    FP8_CONVERTS,
    AttentionConfig,
    _e4m3_words_to_f16,
    paged_attention,
    pick_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.2
# max abs error vs the fp32 reference over the dequantized cache, relative to the output's amax: about twice the
# q dtype's rounding of q and of the output (fp16 2.9e-4 seen, bf16 4.0e-3); the 16-bit dots add no more (fp16
# operands, fp32 accumulation). A scale off by 1/256 exceeds the fp16 bound.
ATOL = {torch.float16: 1.5e-3, torch.bfloat16: 8e-3}


def _fp8_case(query_lens: list[int], seq_lens: list[int], q_dtype: torch.dtype, q_amax: float = 3.0,
              num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16,
              seed: int = 0) -> dict:
    """Caches of random e4m3 codes (every finite code, subnormals and +-448 included; NaN codes excluded),
    blocks shuffled, spare cache blocks all NaN so a stray read would show."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def codes() -> torch.Tensor:
        raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        raw = torch.where((raw & 0x7F) == 0x7F, raw ^ 0x01, raw)  # 0x7f / 0xff are NaN: step to +-448
        return raw.view(torch.float8_e4m3fn)

    k_cache, v_cache = codes(), codes()
    order = torch.randperm(num_blocks, generator=generator).int()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = order[used:used + n]
        table[b, n:] = order[used]  # entries past the sequence: a real block (the reference reads whole rows)
        used += n
    nan = torch.full(shape[1:], float("nan")).to(torch.float8_e4m3fn)
    for spare in order[used:]:
        k_cache[spare] = nan
        v_cache[spare] = nan
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    q = (q * (q_amax / q.abs().max())).to(q_dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": table, "seq_lens": seq_lens,
            "query_lens": query_lens, "qsl": qsl, "k_scale": torch.tensor([0.004]), "v_scale": torch.tensor([0.003])}


def _check(case: dict, config: AttentionConfig, atol: float) -> None:
    expected = ref.paged_attention(case["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    assert expected.isfinite().all()
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = paged_attention(to(case["q"]), to(case["k_cache"]), to(case["v_cache"]), to(case["block_tables"]),
                          to(torch.tensor(case["seq_lens"], dtype=torch.int32)), to(case["qsl"]),
                          max(case["query_lens"]), max(case["seq_lens"]), SCALE, config=config,
                          k_scale=to(case["k_scale"]), v_scale=to(case["v_scale"]))
    assert out.dtype == case["q"].dtype
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0.0, atol=atol * expected.abs().max().item())


@pytest.mark.parametrize("convert", ["f16", "f16_bits", "f16_words", "f16_vwords"])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_fp8_decode_and_chunks_match_reference(convert: str, q_dtype: torch.dtype) -> None:
    """Decode rows and a chunk over cached context (both launches), 16-key tiles so each crosses blocks."""
    case = _fp8_case([1, 6, 1], [37, 21, 9], q_dtype)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert=convert)
    _check(case, config, ATOL[q_dtype])


@pytest.mark.parametrize("convert", ["f16", "f16_bits", "f16_words"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_decode_wide_tiles_match_reference(convert: str, num_splits: int) -> None:
    """128-key decode tiles (the fp8 default) over sequences shorter and longer than a tile, split or not."""
    case = _fp8_case([1, 1, 1], [150, 7, 64], torch.float16, head_dim=16, seed=1)
    config = AttentionConfig(num_splits=num_splits, decode_tile_n=128, fp8_convert=convert, heads_fast=True)
    _check(case, config, ATOL[torch.float16])


@pytest.mark.parametrize("convert", ["f16", "f16_words"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_decode_keys_on_m_matches_reference(convert: str, num_splits: int) -> None:
    """Transposed decode dots (keys on M, the query heads on N) over whole and partial 64-key tiles, beside a
    chunk over cached context (which keeps the untransposed tiles)."""
    case = _fp8_case([1, 1, 4, 1], [150, 7, 40, 64], torch.float16, num_heads=8, num_kv_heads=2, seed=5)
    config = AttentionConfig(num_splits=num_splits, decode_tile_n=64, fp8_convert=convert, decode_keys_on_m=True,
                             prefill_block_m=16, prefill_tile_n=16)
    _check(case, config, ATOL[torch.float16])


@pytest.mark.parametrize("q_amax", [1e-3, 6e4])
def test_fp8_fp16_dots_keep_q_in_range(q_amax: float) -> None:
    """q is rescaled to fp16 once per program: a tiny q keeps its precision (no subnormal fp16), and a bf16 q
    near the fp16 limit (scores in the thousands: near one-hot softmax) does not overflow."""
    case = _fp8_case([1, 3], [20, 19], torch.bfloat16, q_amax=q_amax, seed=2)
    _check(case, AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16), ATOL[torch.bfloat16])


def test_fp8_native_conversion_still_served() -> None:
    """The old path (K/V to q's dtype) stays selectable; fp16 q here (the interpreter's bf16 dots are inexact)."""
    case = _fp8_case([1, 5], [33, 12], torch.float16, seed=3)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert="native")
    _check(case, config, ATOL[torch.float16])


def test_fp8_config_checked_and_defaults() -> None:
    case = _fp8_case([1], [5], torch.float16)
    with pytest.raises(ValueError, match="fp8_convert"):
        _check(case, AttentionConfig(fp8_convert="e5m2"), 1.0)
    assert set(FP8_CONVERTS) == {"native", "f16", "f16_bits", "f16_words", "f16_vwords"}
    decode = pick_config(64, 64, 8, 2, 1, 1024, fp8_kv=True)
    assert decode.decode_tile_n == 64 and decode.fp8_convert == "f16_words"  # measured fastest (kv_fp8_bench)
    assert pick_config(64, 64, 8, 2, 1, 1024).decode_tile_n == 64
    chunks = (2048, 4, 8, 2, 512, 1536)  # 4 x 512 new queries over 1024 cached tokens
    assert pick_config(*chunks, fp8_kv=True).prefill_tile_n == 64
    assert pick_config(*chunks).prefill_tile_n == 32  # a bf16 cache keeps its chunk tiles


@pytest.mark.parametrize("head_dim", [24, 18])
def test_fp8_word_tiles_odd_head_dims(head_dim: int) -> None:
    """Word loads with a head_dim below its power-of-two tile (24: masked words), and one that is not whole words
    (18: falls back to byte tiles), in decode rows and a chunk over cached context."""
    case = _fp8_case([1, 6, 1], [37, 21, 9], torch.float16, head_dim=head_dim, seed=4)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert="f16_words")
    _check(case, config, ATOL[torch.float16])


@triton.jit
def _words_kernel(words_ptr, out_ptr, NUM_WORDS: tl.constexpr, USE_ASM: tl.constexpr):
    offs = tl.arange(0, NUM_WORDS)
    words = tl.load(words_ptr + offs[None, :] + tl.arange(0, 2)[:, None] * NUM_WORDS)  # [2, NUM_WORDS]
    halves = _e4m3_words_to_f16(words, USE_ASM)  # [2, 4 NUM_WORDS]
    cols = tl.arange(0, 4 * NUM_WORDS)
    tl.store(out_ptr + tl.arange(0, 2)[:, None] * (4 * NUM_WORDS) + cols[None, :], halves)


@pytest.mark.parametrize("use_asm", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE != "cuda" or os.environ.get("TRITON_INTERPRET") == "1", reason="PTX inline asm needs a GPU"))])
def test_e4m3_words_convert_every_code(use_asm: bool) -> None:
    """All 256 e4m3 codes (twice, each at every byte position of a word) to fp16 equal torch's cast. The NaN codes
    (never in a cache: quantization clamps to +-448) become NaN on the GPU; the interpreter's cast reads them
    as +-480, so there they are left out."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    raw = torch.cat([codes, codes.flip(0)]).to(DEVICE)  # [512] bytes: each code at every byte position of a word
    want = raw.view(torch.float8_e4m3fn).to(torch.float16).view(2, 256)
    out = torch.empty(2, 256, dtype=torch.float16, device=DEVICE)
    _words_kernel[(1,)](raw.view(torch.int32), out, NUM_WORDS=64, USE_ASM=use_asm)
    out, want = out.cpu(), want.cpu()
    if not use_asm:
        finite = want.isfinite()
        out, want = out[finite], want[finite]
    torch.testing.assert_close(out, want, rtol=0.0, atol=0.0, equal_nan=True)
