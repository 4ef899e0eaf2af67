"""Split-KV decode with far more splits than key tiles (what a CUDA graph captured for max_model_len runs at short
contexts): empty splits write only (max, sum) and the reduce never reads their partial outputs, so whatever those
buffers hold (NaN here) cannot reach the result. For paged attention and MLA."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import mla
from pagoda.kernels import reference as ref
from pagoda.kernels.paged_attention import paged_attention
from tests.test_kernels import AttentionCase, make_paged_batch, reference_attention, small_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty returns NaN-filled float tensors: a partial buffer read before being written poisons the row."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("splits", [8, 16])
def test_paged_attention_with_mostly_empty_splits(nan_empty: None, splits: int) -> None:
    # 16-key tiles: 1, 3 and 9 tiles over `splits` splits; a graph padding sequence and padding rows as well
    case = AttentionCase((1, 1, 1), (5, 40, 129), num_pad_seqs=1, pad_tokens=2, config=small_tiles(splits))
    batch = make_paged_batch(case, torch.float32, DEVICE)
    scale = case.head_dim ** -0.5
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                          batch.query_start_loc, 1, max(case.seq_lens), scale, config=case.config)
    real = batch.num_real_tokens
    torch.testing.assert_close(out[:real].float(), reference_attention(batch, case, scale), atol=1e-4, rtol=0)
    assert bool((out[real:] == 0).all()), "padding rows must come out exactly zero"


def test_mla_decode_with_mostly_empty_splits(nan_empty: None) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, lat, rope, block_size = 4, 32, 16, 8
    seq_lens = [3, 30, 70]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(num_blocks, block_size, lat + rope, generator=gen)  # [N, bs, R + P]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for b, n in enumerate(blocks):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    q = torch.randn(len(seq_lens), heads, lat + rope, generator=gen)  # [T, heads, R + P]
    config = mla.MLAConfig(num_splits=16, block_h=16, decode_tile_n=16)
    args = (cache.to(DEVICE), table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE))
    out = mla.mla_attention(q.to(DEVICE), *args, 1, max(seq_lens), 0.1, lat, config=config)
    expected = ref.mla_attention(q, cache, table, seq_lens, [1] * len(seq_lens), 0.1, lat)
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=1e-4, rtol=0)
