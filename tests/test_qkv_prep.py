"""The fused q/k norm + rope + K/V write kernel against its PyTorch reference (the unfused ops, step by step)."""

from __future__ import annotations

import zlib

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.qkv_prep import prepare_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            cache_dtype: torch.dtype, qk_norm: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks, max_pos = 8, 6, 64
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 8, generator=gen)[:, :width]  # strided rows, as a view would be
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = ref.rope_cos_sin(inv_freq, torch.arange(max_pos), dtype)  # [max_pos, D] each
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[num_tokens // 2] = -1  # a padding token: q is still rotated, nothing is stored
    return dict(
        qkv=qkv.to(dtype), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        q_norm=(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if qk_norm else None,
        k_norm=(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if qk_norm else None,
        eps=1e-6, cos=cos, sin=sin, positions=torch.randint(0, max_pos, (num_tokens,), generator=gen),
        k_cache=torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype),
        v_cache=torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype),
        slot_mapping=slots,
        k_scale=torch.tensor([0.03]) if cache_dtype == torch.float8_e4m3fn else None,
        v_scale=torch.tensor([0.01]) if cache_dtype == torch.float8_e4m3fn else None)


def _on(args: dict, device: str) -> dict:
    return {k: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


CASES = {
    # (tokens, heads, kv heads, head_dim, qk_norm, cache dtype or None for the compute dtype)
    "qwen3-like": (5, 4, 2, 32, True, None),
    "llama-like-no-norm": (4, 4, 2, 32, False, None),
    "odd-heads-d24": (3, 6, 3, 24, True, None),  # heads 6 -> 8 padded, half 12 -> 16 padded
    "mha-d16": (3, 2, 2, 16, False, None),
    "fp8-cache": (4, 4, 2, 32, True, torch.float8_e4m3fn),
}


def _dtypes() -> list:
    dtypes: list = [torch.float32, torch.float16]
    if torch.cuda.is_available():
        dtypes.append(pytest.param(torch.bfloat16, marks=pytest.mark.gpu))
    return dtypes


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_prepare_qkv_matches_reference(name: str, dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, head_dim, qk_norm, cache_dtype = CASES[name]
    args = _inputs(tokens, heads, kv_heads, head_dim, dtype, cache_dtype or dtype, qk_norm,
                   seed=zlib.crc32(f"{name}{dtype}".encode()))
    expected_args = _on(args, "cpu")
    expected_q = ref.prepare_qkv(**expected_args).clone()
    ours = _on(args, DEVICE)
    untouched = ours["qkv"][:, heads * head_dim:].clone()
    q = prepare_qkv(**ours)
    tol = TOL[dtype]
    assert q.data_ptr() == ours["qkv"].data_ptr(), "q must be a view of qkv, rewritten in place"
    torch.testing.assert_close(q.cpu().float(), expected_q.float(), atol=tol, rtol=tol)
    assert torch.equal(ours["qkv"][:, heads * head_dim:], untouched), "k/v columns of qkv must stay as they were"
    for cache in ("k_cache", "v_cache"):
        got, want = ours[cache].cpu(), expected_args[cache]
        if cache_dtype == torch.float8_e4m3fn:
            # One e4m3 step apart at most where the input to the rounding differs by an ulp (bf16 on the GPU):
            # 12.5% of the value, or the subnormal step 2**-9 near zero.
            torch.testing.assert_close(got.float(), want.float(), atol=2.0**-9, rtol=0.13)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    padded = int(args["slot_mapping"][tokens // 2])
    assert padded == -1
    written = (expected_args["k_cache"].float().abs().sum(dim=(2, 3)) > 0).sum().item()
    assert written == tokens - 1, "every non-padding token's K lands in one slot, the padding token's nowhere"


def test_prepare_qkv_rejects_bad_shapes() -> None:
    args = _inputs(3, 4, 2, 32, torch.float32, torch.float32, True, seed=1)
    with pytest.raises(ValueError, match="qkv must be"):
        prepare_qkv(**{**args, "num_heads": 5})
    with pytest.raises(ValueError, match="come together"):
        prepare_qkv(**{**args, "k_norm": None})
    with pytest.raises(ValueError, match="positions"):
        prepare_qkv(**{**args, "positions": args["positions"][:2]})
    with pytest.raises(ValueError, match="fp8 cache needs"):
        fp8 = torch.zeros(args["k_cache"].shape, dtype=torch.float8_e4m3fn)
        prepare_qkv(**{**args, "k_cache": fp8, "v_cache": fp8.clone()})


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("name", ["qwen3-like", "odd-heads-d24", "fp8-cache"])
def test_prepare_qkv_from_split_k_partials_equals_their_sum(name: str, dtype: torch.dtype) -> None:
    """A weight-only qkv GEMM's split-K partials (fp8_weight_only.DeferredSum) taken as they are: q (now a new
    tensor) and the cache entries are those of the rows the GEMM's own sum kernel would have written, bit for
    bit; the qkv rows are never materialised."""
    from pagoda.kernels.fp8_weight_only import DeferredSum

    tokens, heads, kv_heads, head_dim, qk_norm, cache_dtype = CASES[name]
    args = _on(_inputs(tokens, heads, kv_heads, head_dim, dtype, cache_dtype or dtype, qk_norm, seed=7), DEVICE)
    width = args["qkv"].shape[1]
    parts = torch.randn(3, tokens, width, generator=torch.Generator().manual_seed(8)).to(DEVICE)  # [S, T, width]
    deferred = DeferredSum(parts, dtype)
    summed = _on({**args, "qkv": deferred.materialize()}, DEVICE)  # [T, width]: the sum kernel's rows
    expected_q = prepare_qkv(**summed)
    q = prepare_qkv(**{**args, "qkv": deferred})
    assert q.shape == (tokens, heads, head_dim) and q.dtype == dtype and q.is_contiguous()
    assert torch.equal(q, expected_q)
    for cache in ("k_cache", "v_cache"):
        assert torch.equal(args[cache].view(torch.uint8), summed[cache].view(torch.uint8))
    with pytest.raises(ValueError, match="partials must be fp32"):
        prepare_qkv(**{**args, "qkv": DeferredSum(parts.half(), dtype)})
