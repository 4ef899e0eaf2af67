"""The decode launch's PRELOAD_KV path (each split's first cached key tile loaded before pdl.wait, then attended
first): the same sums in the same order as the plain loop, so bit-identical outputs, on every decode layout the
batch can take (splits with and without a preloadable tile, padding programs, empty sequences, keys on M)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagoda.kernels.paged_attention import paged_attention, preload_kv
from tests.test_kernels import SMALL_TILES, AttentionCase, make_paged_batch, reference_attention, small_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    # 16-key tiles: contexts 69 / 4 / 128 give 4, 0 and 8 whole tiles before the new key
    "split1": AttentionCase((1, 1, 1), (70, 5, 129), config=SMALL_TILES),
    "split3": AttentionCase((1, 1, 1), (70, 5, 129), config=small_tiles(3)),
    # more splits than tiles: empty splits and splits whose only tile holds the new key
    "split4-short": AttentionCase((1, 1), (33, 1), config=small_tiles(4)),
    "graph-padding-split2": AttentionCase((1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3,
                                          config=replace(small_tiles(2), heads_fast=True)),
    "keys-on-m": AttentionCase((1, 1), (50, 17), num_heads=8, num_kv_heads=2,
                               config=replace(small_tiles(2), decode_keys_on_m=True)),
    # a sequence with no query row this step returns before attending (and still waits under PDL)
    "empty-query": AttentionCase((1, 0, 1), (40, 6, 21), config=small_tiles(2)),
}


def _run(case: AttentionCase, batch, monkeypatch: pytest.MonkeyPatch, mode: str) -> torch.Tensor:
    monkeypatch.setenv("PAGODA_ATTN_PRELOAD", mode)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                    batch.query_start_loc, 1, max(case.seq_lens), case.head_dim ** -0.5, out=out,
                    config=case.config)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_preloaded_first_tile_equals_the_loop(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    batch = make_paged_batch(case, dtype, DEVICE)
    plain = _run(case, batch, monkeypatch, "0")
    preloaded = _run(case, batch, monkeypatch, "force")
    real = batch.num_real_tokens
    assert torch.equal(preloaded[:real], plain[:real])
    assert bool((preloaded[real:] == 0).all()), "padding rows must come out exactly zero"
    expected = reference_attention(batch, case, case.head_dim ** -0.5)
    torch.testing.assert_close(preloaded[:real].float(), expected, atol=2e-2 if dtype != torch.float32 else 1e-4,
                               rtol=0)


def test_preload_only_under_pdl_over_a_16_bit_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_ATTN_PRELOAD", "1")
    assert preload_kv(True, 0) and not preload_kv(False, 0) and not preload_kv(True, 4)
    monkeypatch.setenv("PAGODA_ATTN_PRELOAD", "force")
    assert preload_kv(False, 0) and not preload_kv(False, 4)
    monkeypatch.setenv("PAGODA_ATTN_PRELOAD", "0")
    assert not preload_kv(True, 0)
