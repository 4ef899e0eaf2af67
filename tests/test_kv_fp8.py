"""Paged attention over an fp8 (e4m3) KV cache: each conversion path and tile size against the PyTorch reference."""

from __future__ import annotations

import os
from dataclasses import replace

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
              seed: int = 0, gaussian: bool = False) -> dict:
    """Caches of random e4m3 codes (every finite code, subnormals and +-448 included; NaN codes excluded), or with
    gaussian=True of normal values quantized as the cache writer does (std 100 codes, clamped to +-448), blocks
    shuffled, spare cache blocks all NaN so a stray read would show."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def codes() -> torch.Tensor:
        if gaussian:
            return (torch.randn(shape, generator=generator) * 100.0).clamp(-448, 448).to(torch.float8_e4m3fn)
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


def _run(case: dict, config: AttentionConfig) -> torch.Tensor:
    """The Triton kernel on the case: [T, heads, D] fp32 on the CPU."""
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = paged_attention(to(case["q"]), to(case["k_cache"]), to(case["v_cache"]), to(case["block_tables"]),
                          to(torch.tensor(case["seq_lens"], dtype=torch.int32)), to(case["qsl"]),
                          max(case["query_lens"]), max(case["seq_lens"]), SCALE, config=config,
                          k_scale=to(case["k_scale"]), v_scale=to(case["v_scale"]))
    assert out.dtype == case["q"].dtype
    return out.float().cpu()


def _check(case: dict, config: AttentionConfig, atol: float) -> None:
    expected = ref.paged_attention(case["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    assert expected.isfinite().all()
    torch.testing.assert_close(_run(case, config), expected, rtol=0.0, atol=atol * expected.abs().max().item())


@pytest.mark.parametrize("convert", ["f16", "f16_bits", "f16_words", "f16_vwords", "f16_pinned"])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_fp8_decode_and_chunks_match_reference(convert: str, q_dtype: torch.dtype) -> None:
    """Decode rows and a chunk over cached context (both launches), 16-key tiles so each crosses blocks."""
    case = _fp8_case([1, 6, 1], [37, 21, 9], q_dtype)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert=convert)
    _check(case, config, ATOL[q_dtype])


@pytest.mark.parametrize("convert", ["f16", "f16_bits", "f16_words", "f16_pinned"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_decode_wide_tiles_match_reference(convert: str, num_splits: int) -> None:
    """128-key decode tiles (the fp8 default) over sequences shorter and longer than a tile, split or not."""
    case = _fp8_case([1, 1, 1], [150, 7, 64], torch.float16, head_dim=16, seed=1)
    config = AttentionConfig(num_splits=num_splits, decode_tile_n=128, fp8_convert=convert, heads_fast=True)
    _check(case, config, ATOL[torch.float16])


@pytest.mark.parametrize("convert", ["f16", "f16_words", "f16_pinned"])
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
    assert set(FP8_CONVERTS) == {"native", "f16", "f16_bits", "f16_words", "f16_vwords", "qk_fp8", "qkv_fp8",
                                 "f16_pinned", "qk_fp8x2"}
    decode = pick_config(64, 64, 8, 2, 1, 1024, fp8_kv=True)
    assert decode.decode_tile_n == 64 and decode.fp8_convert == "qk_fp8x2"  # measured fastest (kv_fp8_bench)
    assert decode.decode_keys_on_m  # the fp8 MMA takes the keys on M
    assert decode.num_splits == 1 and decode.decode_pipelined  # the Gluon kernel where it runs (sm_90)
    assert not pick_config(1, 1, 8, 2, 1, 4096, fp8_kv=True).decode_pipelined  # split launches: Triton's
    assert not pick_config(2048 + 124, 128, 8, 2, 512, 1536, fp8_kv=True).decode_pipelined  # rows beside chunks
    from pagoda.kernels import paged_attention as pa
    for head_dim, expected in ((16, "f16_words"), (32, "qk_fp8x2"), (128, "qk_fp8x2")):  # the fp8 MMA's K >= 32
        small = _fp8_case([1], [5], torch.bfloat16, head_dim=head_dim)
        config = pick_config(1, 1, 2, 2, 1, 5, fp8_kv=True, head_dim=head_dim)
        mode = pa._fp8_mode(True, torch.bfloat16, config.fp8_convert, head_dim, small["k_cache"], small["v_cache"],
                            64)
        assert mode == pa._FP8_MODE[expected], (head_dim, mode)
        transposed = pa._keys_on_m(config.decode_keys_on_m, config.fp8_convert, mode)
        assert transposed == (expected == "qk_fp8x2")  # no transposed dots for a conversion
    small = _fp8_case([1], [5], torch.bfloat16, head_dim=32)
    qkv = AttentionConfig(fp8_convert="qkv_fp8", decode_keys_on_m=True)
    for key_tile, expected in ((16, "qk_fp8"), (32, "qkv_fp8"), (64, "qkv_fp8")):  # PV's K is the key tile
        mode = pa._fp8_mode(True, torch.bfloat16, qkv.fp8_convert, 32, small["k_cache"], small["v_cache"], key_tile)
        assert mode == pa._FP8_MODE[expected], (key_tile, mode)
    assert pick_config(64, 64, 8, 2, 1, 1024).decode_tile_n == 64
    chunks = (2048, 4, 8, 2, 512, 1536)  # 4 x 512 new queries over 1024 cached tokens
    fp8_chunks, bf16_chunks = pick_config(*chunks, fp8_kv=True), pick_config(*chunks)
    assert (fp8_chunks.prefill_tile_n, bf16_chunks.prefill_tile_n) == (64, 32)  # 64-key tiles won for fp8:
    assert fp8_chunks.fp8_q_staged and fp8_chunks.prefill_max_regs == 128  # q staged, registers capped
    assert bf16_chunks.prefill_max_regs == 0
    assert pick_config(*chunks, fp8_kv=True, head_dim=256).prefill_max_regs == 0  # its accumulator alone is 128
    short = pick_config(4 * 64, 4, 8, 2, 64, 1088, fp8_kv=True)  # 4 x 64 queries: unstaged 64-key tiles won there
    assert (short.fp8_q_staged, short.prefill_tile_n, short.prefill_max_regs) == (False, 64, 0)
    assert pick_config(4 * 64, 4, 8, 2, 64, 1088).prefill_tile_n == 32  # bf16 unchanged
    with pytest.raises(ValueError, match="prefill_max_regs"):
        _check(case, AttentionConfig(prefill_max_regs=16), 1.0)


@pytest.mark.parametrize("convert", ["f16_words", "qk_fp8"])
def test_fp8_chunk_q_staged_through_out_rows(convert: str) -> None:
    """Staging the converted q through the output rows (fp16, or e4m3 codes in a row's first half) gives the same
    output as q kept in registers (bit for bit in the interpreter), and the reference's within its tolerance;
    chunks of several 16-row tiles beside a decode row, padding rows past qsl[B] come out zero and every row is
    written (out starts as NaN); the register cap is accepted (the interpreter ignores it)."""
    case = _fp8_case([20, 1, 7], [45, 9, 7], torch.float16, seed=6)
    num_rows = case["q"].shape[0] + 3  # 3 padding rows
    q = torch.cat([case["q"], torch.randn(3, *case["q"].shape[1:]).half()])  # [T + 3, heads, D]
    outs = []
    for staged in (True, False):
        config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert=convert,
                                 fp8_q_staged=staged, prefill_max_regs=128 if staged else 0)
        out = torch.full((num_rows, *q.shape[1:]), float("nan"), dtype=q.dtype, device=DEVICE)  # [T + 3, heads, D]
        paged_attention(q.to(DEVICE), case["k_cache"].to(DEVICE), case["v_cache"].to(DEVICE),
                        case["block_tables"].to(DEVICE), torch.tensor(case["seq_lens"], dtype=torch.int32,
                                                                      device=DEVICE),
                        case["qsl"].to(DEVICE), 20, 45, SCALE, out=out, config=config,
                        k_scale=case["k_scale"].to(DEVICE), v_scale=case["v_scale"].to(DEVICE))
        outs.append(out.float().cpu())
    staged_out, register_out = outs
    if DEVICE == "cpu":  # the same arithmetic; on the GPU two compiles may fuse the fp32 softmax ops differently
        assert torch.equal(staged_out, register_out)
    torch.testing.assert_close(staged_out, register_out, rtol=0.0, atol=1e-3 * register_out.abs().max().item())
    assert (staged_out[-3:] == 0).all()
    # qk_fp8 against the reference fed its row-quantized q (as test_qk_fp8_matches_row_quantized_q)
    ref_q = case["q"].float() if convert == "f16_words" else _quantize_q_rows(case["q"]).float()
    expected = ref.paged_attention(ref_q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                                   case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    torch.testing.assert_close(staged_out[:-3], expected, rtol=0.0,
                               atol=ATOL[torch.float16] * expected.abs().max().item())


@pytest.mark.parametrize("head_dim", [24, 18])
def test_fp8_word_tiles_odd_head_dims(head_dim: int) -> None:
    """Word loads with a head_dim below its power-of-two tile (24: masked words), and one that is not whole words
    (18: falls back to byte tiles), in decode rows and a chunk over cached context."""
    case = _fp8_case([1, 6, 1], [37, 21, 9], torch.float16, head_dim=head_dim, seed=4)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert="f16_words")
    _check(case, config, ATOL[torch.float16])


def _quantize_q_rows(q: torch.Tensor) -> torch.Tensor:
    """What "qk_fp8" gives the tensor cores, dequantized: each (token, head) row of q to e4m3 with scale
    amax / 448 (round to nearest even), times the scale. [T, heads, D] fp32."""
    q32 = q.float()
    amax = q32.abs().amax(-1, keepdim=True)  # [T, heads, 1]
    inv = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    row_scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (q32 * inv).clamp(-448, 448).to(torch.float8_e4m3fn).float() * row_scale


def _qk_fp8_error_bound(case: dict, expected: torch.Tensor) -> torch.Tensor:
    """Per (token, head) bound on |out - exact| for "qk_fp8", from q's e4m3 rounding alone. Each element of
    q / row_scale is rounded by at most 2^-4 of itself (3 mantissa bits) or, below the normals, by 2^-10 (half the
    2^-9 spacing), so a score s_j = scale q.k_j moves by at most E_j = scale sum_d (2^-4 |q_d| + 2^-10 row_scale)
    |k_dj|. Softmax weights then change by a factor within exp(+-2 E), E = max_j E_j, so the output
    o = sum_j p_j v_j = o + sum_j (p'_j - p_j)(v_j - o) moves by at most (exp(2 E) - 1) max_j |v_j - o| per
    channel. [T, heads] fp32."""
    q = case["q"].float()  # [T, heads, D]
    heads, kv_heads = q.shape[1], case["k_cache"].shape[2]
    row_scale = q.abs().amax(-1, keepdim=True) / 448.0  # [T, heads, 1]
    slack = 2.0 ** -4 * q.abs() + 2.0 ** -10 * row_scale  # [T, heads, D]
    bound = torch.zeros(q.shape[:2])
    for b, (start, query_len) in enumerate(zip(case["qsl"].tolist()[:-1], case["query_lens"], strict=True)):
        seq_len = case["seq_lens"][b]
        k = ref.gather_kv(case["k_cache"], case["block_tables"][b], seq_len).float() * case["k_scale"]  # [L, kvh, D]
        v = ref.gather_kv(case["v_cache"], case["block_tables"][b], seq_len).float() * case["v_scale"]
        for t in range(start, start + query_len):
            visible = seq_len - query_len + (t - start) + 1  # causal: keys 0..position
            for h in range(heads):
                kv = h // (heads // kv_heads)
                err = SCALE * (k[:visible, kv].abs() @ slack[t, h]).max()  # max_j E_j
                spread = (v[:visible, kv] - expected[t, h]).abs().max()  # max_j |v_j - o| over channels
                bound[t, h] = torch.expm1(2 * err) * spread
    return bound


@pytest.mark.parametrize(("num_splits", "keys_on_m"), [(1, False), (4, False), (1, True)])
def test_qk_fp8_matches_row_quantized_q(num_splits: int, keys_on_m: bool) -> None:
    """"qk_fp8" computes attention of the row-quantized q exactly (fp32 scores of e4m3 x e4m3): against the
    reference fed that q it meets the fp16 paths' bound, in decode rows (split or not, transposed dots or not) and
    a chunk over cached context; rows of very different magnitudes keep their own scales."""
    case = _fp8_case([1, 6, 1, 1], [37, 21, 9, 70], torch.float16, num_heads=8, num_kv_heads=2, seed=6)
    case["q"][:, 1] *= 1e-3  # one head far smaller than the rest: a per-tensor scale would flush it to zero
    quantized = {**case, "q": _quantize_q_rows(case["q"]).to(torch.float16)}
    config = AttentionConfig(num_splits=num_splits, decode_tile_n=64 if keys_on_m else 16, prefill_block_m=16,
                             prefill_tile_n=16, fp8_convert="qk_fp8", decode_keys_on_m=keys_on_m)
    expected = ref.paged_attention(quantized["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    out = _run(case, config)
    torch.testing.assert_close(out, expected, rtol=0.0, atol=ATOL[torch.float16] * expected.abs().max().item())


@pytest.mark.parametrize(("num_splits", "keys_on_m"), [(1, False), (4, True)])
def test_qkv_fp8_within_p_rounding_of_row_quantized_q(num_splits: int, keys_on_m: bool) -> None:
    """"qkv_fp8" also rounds p * 2^8 to e4m3 for the PV dot (V as loaded); the softmax sum keeps the exact p. Each
    weight then moves by at most 2^-4 of itself (p >= 2^-14, normal e4m3) or 2^-18 (below), so against the
    row-quantized-q reference |out - ref| <= (2^-4 + L 2^-18 / l) max |v| per channel, l >= 1 the softmax sum
    (its max term is 1), L the keys; plus the fp16 paths' bound. Gaussian cache, decode rows and a chunk."""
    case = _fp8_case([1, 6, 1, 1], [37, 21, 9, 70], torch.float16, num_heads=8, num_kv_heads=2, seed=8,
                     gaussian=True)
    quantized = {**case, "q": _quantize_q_rows(case["q"]).to(torch.float16)}
    config = AttentionConfig(num_splits=num_splits, decode_tile_n=64 if keys_on_m else 32, prefill_block_m=16,
                             prefill_tile_n=32, fp8_convert="qkv_fp8", decode_keys_on_m=keys_on_m)  # K >= 32
    expected = ref.paged_attention(quantized["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    error = (_run(case, config) - expected).abs()  # [T, heads, D]
    v_max = max(ref.gather_kv(case["v_cache"], case["block_tables"][b], n).float().abs().max().item()
                for b, n in enumerate(case["seq_lens"])) * case["v_scale"].item()
    bound = (2.0 ** -4 + max(case["seq_lens"]) * 2.0 ** -18) * v_max + ATOL[torch.float16] * expected.abs().max()
    assert error.max() <= bound, (error.max(), bound)
    assert error.max() > ATOL[torch.float16] * expected.abs().max()  # p really was rounded to e4m3


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_qk_fp8_error_within_e4m3_rounding_bound(q_dtype: torch.dtype) -> None:
    """Against the exact reference (unquantized q), "qk_fp8"'s error stays within the worst case q's e4m3
    rounding allows (_qk_fp8_error_bound) plus the 16-bit paths' own tolerance. Realistic inputs: a gaussian
    cache, and q with a few large channels, as real queries have, which coarsen every other channel of their row.
    A worst case, so loose: the error measured here is ~1/100 of it (1.3e-2 of the output amax vs 4e-4 for
    "f16_words"); the exact-q test above is the tight check of the kernel."""
    case = _fp8_case([1, 1, 5], [40, 17, 30], q_dtype, num_heads=4, num_kv_heads=2, seed=7, gaussian=True)
    q = case["q"].float()
    q[..., :2] *= 8.0  # two outlier channels
    case["q"] = q.to(q_dtype)
    config = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16, fp8_convert="qk_fp8")
    expected = ref.paged_attention(case["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    error = (_run(case, config) - expected).abs().amax(-1)  # [T, heads]
    bound = _qk_fp8_error_bound(case, expected) + ATOL[q_dtype] * expected.abs().max()
    assert (error <= bound).all(), (error, bound)
    assert error.max() > 0  # q really was rounded: the bound is what it is measured against


@pytest.mark.parametrize(("num_splits", "keys_on_m", "q_dtype"),
                         [(1, False, torch.float16), (4, True, torch.float16), (1, True, torch.bfloat16)])
def test_qk_fp8x2_as_accurate_as_16_bit_q(num_splits: int, keys_on_m: bool, q_dtype: torch.dtype) -> None:
    """"qk_fp8x2" (q as two e4m3 terms, two fp8 dots over the same K tile) meets the 16-bit paths' bound against the
    exact reference (unquantized q), where "qk_fp8" (one e4m3 term) does not: on realistic inputs, a gaussian cache
    and q with a few large channels, in decode rows (split or not, transposed dots or not) and a chunk over cached
    context."""
    case = _fp8_case([1, 1, 5, 1], [40, 17, 30, 70], q_dtype, num_heads=8, num_kv_heads=2, seed=9, gaussian=True)
    q = case["q"].float()
    q[..., :2] *= 8.0  # two outlier channels
    q[:, 1] *= 1e-3  # one head far smaller than the rest: each row keeps its own scales
    case["q"] = q.to(q_dtype)
    expected = ref.paged_attention(case["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])  # [T, heads, D] fp32
    errors = {}
    for convert in ("qk_fp8x2", "qk_fp8", "f16_words"):
        config = AttentionConfig(num_splits=num_splits, decode_tile_n=64 if keys_on_m else 16, prefill_block_m=16,
                                 prefill_tile_n=16, fp8_convert=convert, decode_keys_on_m=keys_on_m)
        errors[convert] = (_run(case, config) - expected).abs().max().item() / expected.abs().max().item()
    assert errors["qk_fp8x2"] <= ATOL[q_dtype], errors
    assert errors["qk_fp8"] > 2 * errors["qk_fp8x2"], errors  # the second term is what brings it there


def test_fp8_decode_switch_picks_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_FP8_KV_DECODE (bench/step_ab.py's A/B switch) makes decode-only launches over an fp8 cache convert
    as it names, with the keys on M for the fp8 tensor-core modes: the same output as that config passed
    explicitly; chunks keep the default; an unknown mode is refused."""

    from pagoda.kernels.paged_attention import pick_config

    case = _fp8_case([1, 1, 1], [40, 17, 30], torch.float16, num_heads=8, num_kv_heads=2, seed=10)
    default = pick_config(3, 3, 2, 4, 1, 40, fp8_kv=True)
    assert (default.fp8_convert, default.decode_keys_on_m) == ("qk_fp8x2", True)
    explicit = _run(case, replace(default, fp8_convert="f16_words", decode_keys_on_m=False))
    plain = _run(case, default)
    assert torch.equal(_run(case, None), plain)  # type: ignore[arg-type]
    monkeypatch.setenv("PAGODA_FP8_KV_DECODE", "f16_words")
    switched = _run(case, None)  # type: ignore[arg-type]
    assert torch.equal(switched, explicit) and not torch.equal(switched, plain)
    monkeypatch.setenv("PAGODA_FP8_KV_DECODE", "fp4")
    with pytest.raises(ValueError, match="PAGODA_FP8_KV_DECODE"):
        _run(case, None)  # type: ignore[arg-type]
    chunk = _fp8_case([6], [21], torch.float16, num_heads=8, num_kv_heads=2, seed=10)
    assert torch.equal(_run(chunk, None), _run(chunk, pick_config(6, 1, 2, 4, 6, 21, fp8_kv=True)))  # type: ignore[arg-type]


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_blocks_matches_reference(dtype: torch.dtype) -> None:
    """Listed blocks (repeated and out of order) of a cache holding every e4m3 code, times the scales: equal to the
    reference's (one fp32 product, one rounding; bf16 within one unit in the last place, as Triton's interpreter
    does not round its fp32 -> bf16 cast to nearest); an empty list gives empty copies; bad input raises."""
    from pagoda.kernels.kv_cache import dequantize_blocks

    case = _fp8_case([1], [70], torch.float16, head_dim=24, seed=9)
    block_ids = torch.tensor([3, 0, 3, 1], dtype=torch.int32)
    nan_free = torch.tensor(case["block_tables"][0, :5].tolist(), dtype=torch.int32)[block_ids.long()]  # real blocks
    args = [t.to(DEVICE) for t in (case["k_cache"], case["v_cache"], case["k_scale"], case["v_scale"], nan_free)]
    k, v = dequantize_blocks(*args, dtype=dtype)
    want_k, want_v = ref.dequantize_blocks(case["k_cache"], case["v_cache"], case["k_scale"], case["v_scale"],
                                           nan_free, dtype)
    assert k.shape == (4, 16, 2, 24) and k.dtype == dtype
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1" else 0.0
    torch.testing.assert_close(k.cpu(), want_k, rtol=rtol, atol=0.0)
    torch.testing.assert_close(v.cpu(), want_v, rtol=rtol, atol=0.0)
    assert (want_k[0] != 0).any() and not torch.equal(want_k[0], want_k[1])
    empty_k, _ = dequantize_blocks(*args[:4], torch.zeros(0, dtype=torch.int64, device=DEVICE), dtype=dtype)
    assert empty_k.shape == (0, 16, 2, 24)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_blocks(args[0].to(torch.float16), *args[1:])
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_blocks(args[0].transpose(1, 2), args[1].transpose(1, 2), *args[2:])


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 9, 3), (96, 4, 2), (16, 4, 1)])
def test_fp8_default_decode_at_other_head_dims(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """pick_config's decode launch over an fp8 cache (QK^T on fp8 tensor cores, q as two e4m3 terms, keys on M)
    at a head dim that is not a power of two (96: padded to 128), SmolLM2's 64-dim heads in groups of 3, and below
    the fp8 MMA's K (16: the words conversion serves): the reference's values."""
    case = _fp8_case([1, 1, 1], [40, 17, 70], torch.float16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, seed=head_dim, gaussian=True)
    _check(case, None, ATOL[torch.float16])  # type: ignore[arg-type]


@pytest.mark.parametrize(("convert", "tile_n", "keys_on_m", "num_splits", "unroll"),
                         [("qk_fp8x2", 64, True, 1, 1), ("qk_fp8x2", 64, True, 4, 1), ("f16_words", 16, False, 1, 1),
                          ("f16_words", 32, False, 4, 1), ("qk_fp8x2", 64, True, 1, 2), ("f16_words", 16, False, 2, 2)])
def test_fp8_decode_lazy_sum_matches_eager(convert: str, tile_n: int, keys_on_m: bool, num_splits: int,
                                           unroll: int) -> None:
    """decode_lazy_sum (softmax sums kept per key slot, summed once after the tiles) over whole and partial tiles,
    split or not, transposed dots or not, one or two tiles a loop iteration (decode_unroll): within fp32 rounding of
    the per-tile sums, and within the usual bound of the reference; chunks beside the decode rows are unaffected."""
    case = _fp8_case([1, 1, 4, 1], [150, 7, 40, 64], torch.float16, num_heads=8, num_kv_heads=2, seed=11,
                     gaussian=True)
    eager = AttentionConfig(num_splits=num_splits, decode_tile_n=tile_n, fp8_convert=convert,
                            decode_keys_on_m=keys_on_m, prefill_block_m=16, prefill_tile_n=16, decode_unroll=unroll)
    lazy = replace(eager, decode_lazy_sum=True)
    _check(case, lazy, ATOL[torch.float16])
    torch.testing.assert_close(_run(case, lazy), _run(case, eager), rtol=0.0,
                               atol=2e-3 * _run(case, eager).abs().max().item())


@pytest.mark.parametrize(("convert", "tile_n", "keys_on_m", "num_splits"),
                         [("qk_fp8x2", 64, True, 1), ("qk_fp8x2", 16, True, 4), ("f16_words", 16, False, 2)])
def test_fp8_decode_one_loop_changes_nothing(convert: str, tile_n: int, keys_on_m: bool, num_splits: int) -> None:
    """decode_one_loop (every decode tile through the masked loop): the same tiles in the same order with masks
    that pass every key of a whole tile, so the same outputs bit for bit, over sequences of no, one and many whole
    tiles with and without a partial one, split or not; within the usual bound of the reference."""
    case = _fp8_case([1, 1, 4, 1, 1], [150, 7, 40, 64, 128], torch.float16, num_heads=8, num_kv_heads=2, seed=13,
                     gaussian=True)
    two_loops = AttentionConfig(num_splits=num_splits, decode_tile_n=tile_n, fp8_convert=convert,
                                decode_keys_on_m=keys_on_m, decode_lazy_sum=keys_on_m, prefill_block_m=16,
                                prefill_tile_n=16)
    one_loop = replace(two_loops, decode_one_loop=True)
    _check(case, one_loop, ATOL[torch.float16])
    assert torch.equal(_run(case, one_loop), _run(case, two_loops))


def test_decode_rows_beside_chunks_take_their_own_conversion() -> None:
    """decode_fp8_convert: in a step mixing decode rows and chunks, the decode launch converts as it says (qk_fp8x2,
    keys on M, sums per key slot: pick_config's choice for such steps) while the chunks keep fp8_convert: each
    launch's rows equal those of a config using that launch's choice for both, and all meet the reference."""
    case = _fp8_case([1, 6, 1, 5, 1], [70, 21, 9, 40, 33], torch.float16, num_heads=8, num_kv_heads=2, seed=12,
                     gaussian=True)
    words = AttentionConfig(decode_tile_n=64, prefill_block_m=16, prefill_tile_n=16, fp8_convert="f16_words")
    qk2 = replace(words, fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True)
    mixed = replace(words, decode_fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True)
    _check(case, mixed, ATOL[torch.float16])
    out, out_words, out_qk2 = _run(case, mixed), _run(case, words), _run(case, qk2)
    decode_rows = torch.tensor([0, 7, 13])  # the length-1 sequences' rows
    chunk_rows = torch.tensor([i for i in range(out.shape[0]) if i not in decode_rows.tolist()])
    assert torch.equal(out[decode_rows], out_qk2[decode_rows])
    assert torch.equal(out[chunk_rows], out_words[chunk_rows])
    assert not torch.equal(out[decode_rows], out_words[decode_rows])  # the decode launch did convert differently
    with pytest.raises(ValueError, match="decode_fp8_convert"):
        _run(case, replace(words, decode_fp8_convert="e5m2"))
