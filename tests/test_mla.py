"""Multi-head latent attention kernels (kernels/mla.py) against their PyTorch references (kernels/reference.py):
the latent cache write (model dtype and fp8), absorbed attention (decode with and without split-KV, chunks with
cached context, CUDA-graph padding), the expanded path, absorbed == expanded over one cache, and the
de-interleaved rope. CPU: Triton's interpreter on small grids; gpu-marked cases in bf16."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from pagoda.kernels import mla
from pagoda.kernels import reference as ref
from pagoda.kernels.mla import (
    ExpandPolicy,
    MLAConfig,
    mla_attention,
    mla_expanded_attention,
    pick_mla_config,
    write_latent,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max abs error of attention (unit-scale outputs) vs the fp32 reference on the same inputs
ATOL = {torch.float32: 3e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
SMALL = MLAConfig(block_h=4, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16)


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 4
    lat: int = 32  # kv_lora_rank
    rope: int = 16  # qk_rope_head_dim
    block_size: int = 16
    config: MLAConfig | None = SMALL
    num_pad_seqs: int = 0  # CUDA-graph filler sequences: seq_len 0, one query row each
    pad_tokens: int = 0  # rows of q past query_start_loc[B]


@dataclass
class Batch:
    q: torch.Tensor  # [T, heads, R + P]
    cache: torch.Tensor  # [num_blocks, block_size, R + P], NaN wherever no real token lives
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_real_tokens: int


def make_batch(case: Case, dtype: torch.dtype, device: str = DEVICE, q_width: int | None = None) -> Batch:
    """Random q and latent cache; each sequence's blocks drawn from a shuffled pool; slots holding no real token
    are NaN, so reading past a sequence's length shows. q_width: q's last dim (default R + P)."""
    bs, width = case.block_size, case.lat + case.rope
    seq_lens = list(case.seq_lens) + [0] * case.num_pad_seqs
    query_lens = list(case.query_lens) + [1] * case.num_pad_seqs
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    pool = torch.randperm(num_blocks).tolist()
    cache = torch.full((num_blocks, bs, width), float("nan"))  # [N, bs, R + P]
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), max_blocks), pool[0], dtype=torch.int32)
    next_block = 2
    for b, (seq_len, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        for j in range(num_seq_blocks):
            block = pool[next_block]
            next_block += 1
            block_tables[b, j] = block
            rows = min(bs, seq_len - j * bs)
            cache[block, :rows] = torch.randn(rows, width)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_tokens = starts[-1] + case.pad_tokens
    q = torch.randn(num_tokens, case.num_heads, q_width or width)
    return Batch(q.to(device=device, dtype=dtype), cache.to(device=device, dtype=dtype), block_tables.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 torch.tensor(starts, dtype=torch.int32, device=device), sum(case.query_lens))


def _reference(batch: Batch, case: Case, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The absorbed reference in fp32 over the real sequences."""
    num_real = len(case.query_lens)
    cache = batch.cache if batch.cache.dtype == torch.float8_e4m3fn else batch.cache.float()
    return ref.mla_attention(batch.q[:batch.num_real_tokens].float().cpu(), cache.cpu(),
                             batch.block_tables[:num_real].cpu(), list(case.seq_lens), list(case.query_lens), scale,
                             case.lat, None if kv_scale is None else kv_scale.cpu())  # [T_real, heads, R]


def _run(case: Case, dtype: torch.dtype, atol: float) -> None:
    batch = make_batch(case, dtype)
    scale = (case.lat + case.rope) ** -0.5
    out = torch.full((batch.q.shape[0], case.num_heads, case.lat), float("nan"), dtype=dtype, device=DEVICE)
    max_query_len = max(case.query_lens + ((1,) if case.num_pad_seqs else ()))
    result = mla_attention(batch.q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                           max_query_len, max(case.seq_lens), scale, case.lat, out=out, config=case.config)
    assert result is out
    real = out[:batch.num_real_tokens].float().cpu()
    assert not real.isnan().any(), "rows of real sequences left unwritten or NaN"
    err = (real - _reference(batch, case, scale)).abs().max().item()
    assert err < atol, f"max abs err {err:.3e} >= {atol:.1e}"
    assert bool((out[batch.num_real_tokens:] == 0).all()), "padding rows must come out exactly zero"


CASES = {
    # decode rows, a chunk without context, chunks with cached context, a 1-token sequence
    "mixed": Case((1, 9, 5, 1, 17), (37, 9, 40, 1, 50)),
    "decode": Case((1, 1, 1), (70, 5, 33)),
    # 16 keys per tile over blocks of 8 (a tile spans two blocks); 6 heads in blocks of 4 (the last half empty)
    "decode-heads6-bs8": Case((1, 1, 1), (20, 9, 16), num_heads=6, block_size=8),
    "decode-split3": Case((1, 1, 1), (70, 5, 40), config=replace(SMALL, num_splits=3)),
    "decode-graph-padding-split2": Case((1, 1), (33, 2), num_pad_seqs=2, pad_tokens=3,
                                        config=replace(SMALL, num_splits=2)),
    "decode-graph-padding": Case((1, 1), (33, 17), num_pad_seqs=1, pad_tokens=2),
    # rows of several tokens x 4 heads per tile, a padding tail after them; rope dims 24 (padded), latent 40
    "prefill-padding-tail-odd-dims": Case((1, 6, 3), (20, 6, 19), lat=40, rope=24, pad_tokens=3),
    # grid axis 0 = query programs (heads_fast off), 16 heads in one block (the default pick)
    "mixed-default-config": Case((1, 7, 1), (25, 30, 9), num_heads=16, config=None),
    "empty-query-seq": Case((1, 0, 4), (10, 5, 8)),
    # decode transposed (keys as the M dim): split-KV, and graph padding with a partial last tile
    "decode-keys-m-split3": Case((1, 1, 1), (70, 5, 40), config=replace(SMALL, num_splits=3, decode_keys_m=True)),
    "decode-keys-m-graph-padding": Case((1, 1), (33, 17), num_pad_seqs=1, pad_tokens=2,
                                        config=replace(SMALL, decode_keys_m=True)),
    # decode softmax sums per key slot (decode_lazy_sum), beside chunks, split, transposed, with graph padding
    "mixed-lazy-sum": Case((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), config=replace(SMALL, decode_lazy_sum=True)),
    "decode-lazy-sum-split3": Case((1, 1, 1), (70, 5, 40), config=replace(SMALL, num_splits=3,
                                                                          decode_lazy_sum=True)),
    "decode-keys-m-lazy-sum-graph-padding": Case((1, 1), (33, 17), num_pad_seqs=1, pad_tokens=2, config=replace(
        SMALL, decode_keys_m=True, decode_lazy_sum=True)),
    # V3's head count: 64 heads a program for decode rows and chunk tiles (the default pick), split-KV
    "wide-128-heads": Case((1, 3, 1), (40, 12, 17), num_heads=128, config=replace(
        pick_mla_config(3, 128, 3, 40), decode_tile_n=16, prefill_tile_n=16, num_splits=2)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_mla_attention_matches_reference(name: str, dtype: torch.dtype) -> None:
    _run(CASES[name], dtype, ATOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,lat,rope", [(16, 512, 64), (128, 512, 64)])
def test_mla_attention_matches_reference_gpu(num_heads: int, lat: int, rope: int) -> None:
    case = Case((1, 1, 37, 1, 300), (900, 17, 400, 2000, 300), num_heads=num_heads, lat=lat, rope=rope, config=None)
    _run(case, torch.bfloat16, ATOL[torch.bfloat16])


@pytest.mark.parametrize("name", ["mixed", "decode-keys-m-split3"])
def test_mla_attention_reads_split_query_in_place(name: str) -> None:
    """q as the W_UK product's transposed view [T, heads, R] (head-major storage) and q_rope a strided slice of
    another tensor give the same rows as the concatenated query, bit for bit."""
    case = CASES[name]
    batch = make_batch(case, torch.float32)
    scale = (case.lat + case.rope) ** -0.5
    max_query_len = max(case.query_lens)
    q_lat_heads = batch.q[..., :case.lat].transpose(0, 1).contiguous()  # [heads, T, R]
    wider = torch.randn(*batch.q.shape[:2], case.rope + 5, device=DEVICE)  # q_pe inside a wider row
    wider[..., 5:] = batch.q[..., case.lat:]
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, max_query_len, max(case.seq_lens), scale,
            case.lat)
    whole = mla_attention(batch.q, batch.cache, *args, config=case.config)
    split = mla_attention(q_lat_heads.transpose(0, 1), batch.cache, *args, config=case.config,
                          q_rope=wider[..., 5:])
    real = batch.num_real_tokens
    assert torch.equal(split[:real], whole[:real])
    with pytest.raises(ValueError, match="q_rope"):
        mla_attention(batch.q, batch.cache, *args, q_rope=wider[..., 5:])  # q must then hold R values only


def test_pick_mla_config_splits_small_decode_batches_only() -> None:
    assert pick_mla_config(1, 16, 1, 4096).num_splits == 32  # 1 program: split as far as allowed
    assert pick_mla_config(256, 16, 1, 4096).num_splits == 1  # 256 programs fill 132 SMs
    assert pick_mla_config(4, 16, 300, 4096).num_splits == 1  # chunks never split
    assert pick_mla_config(4, 128, 1, 4096).num_splits == 32  # 4 sequences x 2 head blocks of 64: ~2 programs an SM
    assert pick_mla_config(4, 128, 1, 4096, legacy=True).num_splits == 8  # 4 sequences x 8 head blocks of 16
    wide = pick_mla_config(256, 128, 1, 4096)  # V3: 64 heads a program (wgmma's M), both launches
    assert (wide.block_h, wide.prefill_block_m, wide.decode_keys_m) == (64, 64, False)
    # V2-Lite: heads as the M dim of the decode dots when the batch fills the GPU (the H200's fastest, bf16), keys
    # as M for split batches and fp8 caches
    assert not pick_mla_config(256, 16, 1, 4096).decode_keys_m
    assert pick_mla_config(256, 16, 1, 4096, fp8=True).decode_keys_m
    assert pick_mla_config(8, 16, 1, 4096).decode_keys_m
    assert pick_mla_config(2, 4, 1, 4096).block_h == 4
    # decode softmax sums per key slot below 64 heads a program only (the wide programs would spill more)
    assert all(pick_mla_config(b, 16, 1, 4096, fp8=f).decode_lazy_sum for b in (1, 8, 256) for f in (False, True))
    assert not wide.decode_lazy_sum


# ---------------------------------------------------------------------------------------------- cache write


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=str)
def test_write_latent_matches_reference(cache_dtype: torch.dtype) -> None:
    num_tokens, lat, rope, num_blocks, bs = 7, 40, 24, 5, 4
    fused = torch.randn(num_tokens, lat + rope + 8)  # [T, R + P + 8]: kv_c and k_pe are strided views of it
    kv_c, k_pe = fused[:, :lat], fused[:, lat:lat + rope]
    slots = torch.randperm(num_blocks * bs)[:num_tokens]
    slots[2] = -1  # padding: not written
    scale = torch.tensor([0.01]) if cache_dtype == torch.float8_e4m3fn else None
    expected = torch.zeros(num_blocks, bs, lat + rope, dtype=cache_dtype)
    ref.write_latent(kv_c, k_pe, expected, slots, scale)
    ours = torch.zeros(num_blocks, bs, lat + rope, dtype=cache_dtype, device=DEVICE)
    write_latent(kv_c.to(DEVICE), k_pe.to(DEVICE), ours, slots.to(DEVICE), None if scale is None else scale.to(DEVICE))
    assert torch.equal(ours.cpu().view(torch.uint8), expected.view(torch.uint8))
    stored = expected.view(-1, lat + rope)[slots[slots >= 0]].float() * (1.0 if scale is None else scale)
    entries = torch.cat((kv_c, k_pe), -1)[slots >= 0]
    tol = 1e-6 if cache_dtype == torch.float32 else (1e-3 if cache_dtype == torch.float16 else 0.0625)
    assert torch.allclose(stored, entries, rtol=tol, atol=tol * 0.01)
    written = expected.view(-1, lat + rope).float().ne(0).any(dim=1)  # [slots]
    assert written.sum().item() == num_tokens - 1, "the padding token's row must not be stored anywhere"


def test_write_latent_rejects_bad_inputs() -> None:
    cache = torch.zeros(2, 4, 48, device=DEVICE)
    kv_c, k_pe, slots = torch.randn(3, 32, device=DEVICE), torch.randn(3, 16, device=DEVICE), torch.arange(3)
    with pytest.raises(ValueError, match="cache must be"):
        write_latent(kv_c, k_pe, torch.zeros(2, 4, 40, device=DEVICE), slots.to(DEVICE))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latent(kv_c, k_pe, cache, slots[:2].to(DEVICE))
    with pytest.raises(ValueError, match="kv_scale"):
        write_latent(kv_c, k_pe, cache.to(torch.float8_e4m3fn), slots.to(DEVICE))


# ---------------------------------------------------------------------------------------------- fp8 latent cache


FP8_CASES = {"mixed": Case((1, 6, 1), (30, 6, 17)),
             "decode-split2": Case((1, 1, 1), (30, 6, 17), config=replace(SMALL, num_splits=2)),
             "decode-keys-m": Case((1, 1, 1), (30, 6, 17), config=replace(SMALL, decode_keys_m=True)),
             "decode-keys-m-lazy-sum": Case((1, 1, 1), (30, 6, 17), config=replace(SMALL, decode_keys_m=True,
                                                                                   decode_lazy_sum=True))}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_mla_attention_fp8_cache_matches_reference(name: str) -> None:
    case = FP8_CASES[name]
    batch = make_batch(case, torch.float32)
    kv_scale = torch.tensor([0.01], device=DEVICE)
    batch.cache = ref.quantize_fp8(batch.cache.nan_to_num(), kv_scale)  # [N, bs, R + P] e4m3 (entries / 0.01)
    scale = 0.05
    expected = _reference(batch, case, scale, kv_scale)
    # the fp8 reference is the float one over the dequantized cache
    dequant = ref.mla_attention(batch.q[:batch.num_real_tokens].float().cpu(), batch.cache.float().cpu() * 0.01,
                                batch.block_tables.cpu(), list(case.seq_lens), list(case.query_lens), scale, case.lat)
    torch.testing.assert_close(expected, dequant, rtol=1e-5, atol=1e-6)
    out = mla_attention(batch.q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        max(case.query_lens), max(case.seq_lens), scale, case.lat, config=case.config,
                        kv_scale=kv_scale)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [Case((1, 4, 1), (30, 6, 17), num_heads=16, config=None),
                                  Case((1, 2), (20, 9), num_heads=64, config=None)], ids=["16-heads", "64-heads"])
def test_mla_attention_fp8_cache_fp16_dots(case: Case) -> None:
    """A 16-bit q over an fp8 cache: tiles converted to fp16, q scaled once to fp16 (the scale folded into the
    softmax scale); within fp16 rounding of the fp32 reference over the dequantized cache."""
    batch = make_batch(case, torch.float32)
    kv_scale = torch.tensor([0.01], device=DEVICE)
    batch.cache = ref.quantize_fp8(batch.cache.nan_to_num(), kv_scale)  # [N, bs, R + P] e4m3
    q = (batch.q * 3.0).half()  # [T, heads, R + P]: amax far from the fp16 scaling target
    expected = ref.mla_attention(q[:batch.num_real_tokens].float().cpu(), batch.cache.cpu(),
                                 batch.block_tables.cpu(), list(case.seq_lens), list(case.query_lens), 0.05, case.lat,
                                 kv_scale.cpu())
    out = mla_attention(q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        max(case.query_lens), max(case.seq_lens), 0.05, case.lat, config=case.config,
                        kv_scale=kv_scale)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0, atol=ATOL[torch.float16])


# ---------------------------------------------------------------------------------------------- absorbed == expanded


def _absorb(q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int, nope: int,
            v_dim: int) -> torch.Tensor:
    """[q_nope @ W_UK ‖ q_pe]: [T, heads, R + P], W_UK the k_nope rows of kv_b_proj per head."""
    w_uk = w_kv_b.view(num_heads, nope + v_dim, -1)[:, :nope]  # [heads, Dn, R]
    return torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1)


def _unabsorb(out_lat: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int, nope: int, v_dim: int) -> torch.Tensor:
    """[T, heads, R] latent mixes -> [T, heads, Dv] by W_UV (the v rows of kv_b_proj per head)."""
    w_uv = w_kv_b.view(num_heads, nope + v_dim, -1)[:, nope:]  # [heads, Dv, R]
    return torch.einsum("thr,hvr->thv", out_lat, w_uv)


@dataclass
class ExpandCase:
    batch: Batch
    case: Case
    q_nope: torch.Tensor  # [T, heads, Dn]
    q_pe: torch.Tensor  # [T, heads, P]
    w_kv_b: torch.Tensor  # [heads * (Dn + Dv), R]
    nope: int = 24
    v_dim: int = 20
    scale: float = 0.1


def _expand_case(case: Case) -> ExpandCase:
    nope, v_dim = 24, 20
    batch = make_batch(case, torch.float32, q_width=nope + case.rope)
    w_kv_b = torch.randn(case.num_heads * (nope + v_dim), case.lat, device=DEVICE) * case.lat ** -0.5
    return ExpandCase(batch, case, batch.q[..., :nope], batch.q[..., nope:], w_kv_b, nope, v_dim)


def _expanded_reference(x: ExpandCase, seqs: list[int] | None = None) -> torch.Tensor:
    return ref.mla_expanded_attention(x.batch.q, x.batch.cache, x.batch.block_tables, list(x.case.seq_lens),
                                      list(x.case.query_lens), x.w_kv_b, x.nope, x.v_dim, x.scale,
                                      seqs=seqs)  # [T, heads, Dv]


def test_absorbed_decode_equals_expanded_multi_head_attention() -> None:
    """Absorbing W_UK into q and W_UV into the output is exact algebra: absorbed decode over the latent cache
    (reference and kernel, with split-KV) gives the multi-head attention of the expanded K/V over the same cache."""
    case = Case((1, 1, 1, 1), (40, 3, 17, 64), num_heads=6)
    x = _expand_case(case)
    expected = _expanded_reference(x)  # [T, heads, Dv]
    q_abs = _absorb(x.q_nope, x.q_pe, x.w_kv_b, case.num_heads, x.nope, x.v_dim)  # [T, heads, R + P]
    b = x.batch
    absorbed_ref = ref.mla_attention(q_abs, b.cache, b.block_tables, list(case.seq_lens), list(case.query_lens),
                                     x.scale, case.lat)
    torch.testing.assert_close(_unabsorb(absorbed_ref, x.w_kv_b, case.num_heads, x.nope, x.v_dim), expected,
                               rtol=1e-4, atol=1e-5)
    for config in (SMALL, replace(SMALL, num_splits=2)):
        out_lat = mla_attention(q_abs, b.cache, b.block_tables, b.seq_lens, b.query_start_loc, 1, 64, x.scale,
                                case.lat, config=config)
        torch.testing.assert_close(_unabsorb(out_lat, x.w_kv_b, case.num_heads, x.nope, x.v_dim), expected,
                                   rtol=1e-4, atol=1e-5)


def test_mixed_step_splits_between_absorbed_and_expanded_paths() -> None:
    """One step of decode rows, a short chunk and two long chunks (one with cached context): the chunks the policy
    expands, computed by the expanded path over the absorbed kernel's output, leave every row equal to the
    expanded reference (the two paths agree, and the expanded path fills exactly its sequences' rows)."""
    case = Case((1, 3, 9, 12), (30, 20, 9, 40), num_heads=4)
    x = _expand_case(case)
    policy = ExpandPolicy(min_query_len=8, max_seq_len=64)
    expanded_seqs = [b for b in range(4) if policy.expands(case.query_lens[b], case.seq_lens[b])]
    assert expanded_seqs == [2, 3]
    b = x.batch
    q_abs = _absorb(x.q_nope, x.q_pe, x.w_kv_b, case.num_heads, x.nope, x.v_dim)
    out_lat = mla_attention(q_abs, b.cache, b.block_tables, b.seq_lens, b.query_start_loc, 12, 40, x.scale,
                            case.lat, config=SMALL)
    out = _unabsorb(out_lat, x.w_kv_b, case.num_heads, x.nope, x.v_dim)  # [T, heads, Dv]
    rows_expanded = torch.arange(4, 25)  # sequences 2 and 3
    out[rows_expanded] = float("nan")
    # max_rows 45: sequences 2 (9 rows) and 3 (40 rows) go in two launches
    mla_expanded_attention(b.q, b.cache, b.block_tables, list(case.seq_lens), list(case.query_lens), expanded_seqs,
                           x.w_kv_b, x.nope, x.v_dim, x.scale, out, max_rows=45)
    torch.testing.assert_close(out, _expanded_reference(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seqs", [[1, 2], [0, 2, 3]], ids=["one-span", "gathered"])
def test_expanded_path_writes_exactly_its_sequences_rows(seqs: list[int]) -> None:
    """Sequences whose rows form one span are read and written through slices, others through an index: either
    way the chosen sequences' rows equal the reference and every other row is left as it was."""
    case = Case((3, 5, 2, 4), (9, 5, 14, 4), num_heads=2)
    x = _expand_case(case)
    b = x.batch
    out = torch.full((b.q.shape[0], case.num_heads, x.v_dim), float("nan"), device=DEVICE)
    mla_expanded_attention(b.q, b.cache, b.block_tables, list(case.seq_lens), list(case.query_lens), seqs,
                           x.w_kv_b, x.nope, x.v_dim, x.scale, out)
    starts = [0, 3, 8, 10, 14]
    chosen = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for seq in seqs:
        chosen[starts[seq]:starts[seq + 1]] = True
    torch.testing.assert_close(out[chosen], _expanded_reference(x, seqs)[chosen], rtol=1e-4, atol=1e-5)
    assert out[~chosen].isnan().all()


def test_expanded_path_fp8_cache_matches_reference() -> None:
    case = Case((5, 7), (12, 7), num_heads=2)
    x = _expand_case(case)
    kv_scale = torch.tensor([0.02], device=DEVICE)
    x.batch.cache = ref.quantize_fp8(x.batch.cache.nan_to_num(), kv_scale)
    b = x.batch
    out = torch.zeros(b.q.shape[0], case.num_heads, x.v_dim, device=DEVICE)
    mla_expanded_attention(b.q, b.cache, b.block_tables, list(case.seq_lens), list(case.query_lens), [0, 1],
                           x.w_kv_b, x.nope, x.v_dim, x.scale, out, kv_scale=kv_scale)
    expected = ref.mla_expanded_attention(b.q, b.cache, b.block_tables, list(case.seq_lens), list(case.query_lens),
                                          x.w_kv_b, x.nope, x.v_dim, x.scale, kv_scale=kv_scale)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_overlapped_expansion_is_k_and_v_in_one_gemm() -> None:
    """expand_latent_overlapped: K = [k_nope ‖ k_pe] and the last Dv columns of V = v, as expand_latent builds them,
    from one GEMM (k_pe passed through exactly); attention over the two overlapping views puts each head's output
    in its last Dv columns; the fused weight follows the kv_b weight when it changes in place."""
    generator = torch.Generator().manual_seed(7)
    heads, nope, rope, v_dim, lat = 3, 16, 8, 12, 32
    latent = torch.randn(10, lat + rope, generator=generator)  # [L, R + P]
    w_kv_b = torch.randn(heads * (nope + v_dim), lat, generator=generator)
    k, v = mla.expand_latent_overlapped(latent, w_kv_b, heads, nope, v_dim)  # [L, heads, Dn + P] each
    k_ref, v_ref = mla.expand_latent(latent, w_kv_b, heads, nope, v_dim, nope + rope)
    assert k.shape == v.shape == (10, heads, nope + rope)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k[..., nope:], latent[:, None, lat:].expand(10, heads, rope))  # exact pass-through
    torch.testing.assert_close(v[..., -v_dim:], v_ref[..., :v_dim], rtol=1e-5, atol=1e-5)
    q = torch.randn(4, heads, nope + rope, generator=generator)
    probs = torch.einsum("qhd,khd->hqk", q, k).softmax(-1)  # [heads, q, L]
    out = torch.einsum("hqk,khd->qhd", probs, v)[..., -v_dim:]
    expected = torch.einsum("hqk,khd->qhd", probs, v_ref[..., :v_dim])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        w_kv_b.mul_(2.0)  # in place: the cached fused weight is stale and rebuilt
    k2, _ = mla.expand_latent_overlapped(latent, w_kv_b, heads, nope, v_dim)
    torch.testing.assert_close(k2[..., :nope], 2 * k[..., :nope], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # a weight made in inference mode (no version counter): never a stale fused weight
        w_inference = w_kv_b.clone()
        k3, _ = mla.expand_latent_overlapped(latent, w_inference, heads, nope, v_dim)
        w_inference.mul_(0.5)
        k4, _ = mla.expand_latent_overlapped(latent, w_inference, heads, nope, v_dim)
    torch.testing.assert_close(k3, k2)
    torch.testing.assert_close(k4[..., :nope], k[..., :nope], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("nope", [128, 32])
def test_expanded_path_flash_matches_reference_gpu(nope: int) -> None:
    """On CUDA in bf16 the expanded path runs FlashAttention's varlen kernel: chunks with and without cached
    context (its causal mask is bottom-right aligned: a chunk's queries are its sequence's last positions);
    V-2-Lite's head dims (q/k 128 + 64, v 128: K and V overlapping views of one GEMM's output) and q/k narrower
    than v (32 + 64 against 128: q and K zero-padded)."""
    case = Case((300, 40, 513), (300, 1064, 1537), num_heads=16, lat=512, rope=64)
    v_dim = 128
    batch = make_batch(case, torch.bfloat16, q_width=nope + case.rope)
    batch.cache = batch.cache.nan_to_num()
    # q as the model has it: a view into the fused projection's wider rows (the latent columns first)
    num_tokens = batch.q.shape[0]
    wide = torch.zeros(num_tokens, case.lat + case.rope + batch.q[0].numel(), device=DEVICE, dtype=torch.bfloat16)
    wide[:, case.lat + case.rope:] = batch.q.reshape(num_tokens, -1)
    batch.q = wide[:, case.lat + case.rope:].view(num_tokens, case.num_heads, nope + case.rope)
    w_kv_b = (torch.randn(case.num_heads * (nope + v_dim), case.lat, device=DEVICE) * case.lat ** -0.5).to(
        torch.bfloat16)
    scale = (nope + case.rope) ** -0.5
    out = torch.zeros(batch.q.shape[0], case.num_heads, v_dim, device=DEVICE, dtype=torch.bfloat16)
    mla_expanded_attention(batch.q, batch.cache, batch.block_tables, list(case.seq_lens), list(case.query_lens),
                           [0, 1, 2], w_kv_b, nope, v_dim, scale, out)
    expected = ref.mla_expanded_attention(batch.q.float(), batch.cache.float(), batch.block_tables,
                                          list(case.seq_lens), list(case.query_lens), w_kv_b.float(), nope, v_dim,
                                          scale)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_mla_attention_rejects_bad_inputs() -> None:
    batch = make_batch(Case((1, 2), (5, 6)), torch.float32)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 2, 6, 0.1)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_attention(batch.q, batch.cache, *args, 48)
    with pytest.raises(ValueError, match="q must be"):
        mla_attention(batch.q[..., :40], batch.cache, *args, 32)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_attention(batch.q, batch.cache.nan_to_num().to(torch.float8_e4m3fn), *args, 32)
    with pytest.raises(ValueError, match="cache must have"):
        mla_attention(batch.q, batch.cache.half(), *args, 32)
    with pytest.raises(ValueError, match="query_start_loc"):
        mla_attention(batch.q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc[:2], 2, 6, 0.1,
                      32)
    with pytest.raises(ValueError, match="block_h"):
        mla_attention(batch.q, batch.cache, *args, 32, config=replace(SMALL, block_h=3))


# ---------------------------------------------------------------------------------------------- rope, norm, write


def test_interleaved_rope_is_transformers_deepseek_rope() -> None:
    """reference.apply_rope_interleaved is transformers' DeepSeek-V3 interleaved rope (same output order), and
    gives DeepSeek-V2's complex-number rope up to an order both q and k share: equal scores."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    num_tokens, num_heads, rope = 6, 3, 16
    q, k = torch.randn(num_tokens, num_heads, rope), torch.randn(num_tokens, 1, rope)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    positions = torch.tensor([0, 1, 7, 100, 2047, 4096])
    cos, sin = ref.rope_cos_sin(inv_freq, positions, torch.float32)  # [T, P]
    ours_q, ours_k = ref.apply_rope_interleaved(q, cos, sin), ref.apply_rope_interleaved(k, cos, sin)
    v3_q, v3_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None],
                                                 sin[None])  # [1, heads, T, P]
    torch.testing.assert_close(ours_q, v3_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, v3_k[0].transpose(0, 1))
    freqs_cis = torch.polar(torch.ones(num_tokens, rope // 2), positions.float()[:, None] * inv_freq)  # [T, P/2]
    v2_q, v2_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis[None])
    scores = torch.einsum("thd,sd->ths", ours_q, ours_k[:, 0])
    torch.testing.assert_close(scores, torch.einsum("htd,sd->ths", v2_q[0], v2_k[0, 0]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours_q, ref.apply_rope(q, cos, sin)), "interleaved is not rotate-half"


PREPARE_CASES = {
    "fp32-interleaved": (torch.float32, torch.float32, True),
    "fp32-rotate-half": (torch.float32, torch.float32, False),
    "fp16-interleaved": (torch.float16, torch.float16, True),
    "fp32-fp8-cache": (torch.float32, torch.float8_e4m3fn, True),
}


@pytest.mark.parametrize("name", list(PREPARE_CASES))
def test_mla_prepare_matches_reference(name: str) -> None:
    from pagoda.kernels.mla import mla_prepare

    dtype, cache_dtype, interleaved = PREPARE_CASES[name]
    num_tokens, num_heads, nope, rope, lat, num_blocks, bs = 5, 3, 8, 16, 40, 4, 4
    q_proj = torch.randn(num_tokens, num_heads * (nope + rope) + 4).to(dtype)  # q is a strided view of it
    kv_a = torch.randn(num_tokens, lat + rope).to(dtype)
    norm = (1 + 0.1 * torch.randn(lat)).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / rope))
    cos, sin = ref.rope_cos_sin(inv_freq, torch.arange(64), dtype)  # [64, P]
    positions = torch.tensor([3, 0, 63, 17, 5])
    slots = torch.tensor([0, 9, -1, 15, 4])
    scale = torch.tensor([0.02]) if cache_dtype == torch.float8_e4m3fn else None
    results = []
    for fn, device in ((ref.mla_prepare, "cpu"), (mla_prepare, DEVICE)):
        proj = q_proj.clone().to(device)
        q = proj[:, :num_heads * (nope + rope)].view(num_tokens, num_heads, nope + rope)
        cache = torch.zeros(num_blocks, bs, lat + rope, dtype=cache_dtype, device=device)
        fn(q, kv_a.to(device), norm.to(device), 1e-6, cos.to(device), sin.to(device), positions.to(device), cache,
           slots.to(device), None if scale is None else scale.to(device), interleaved)
        results.append((proj.cpu(), cache.cpu()))
    (ref_proj, ref_cache), (our_proj, our_cache) = results
    tol = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(our_proj.float(), ref_proj.float(), rtol=tol, atol=tol)
    assert torch.equal(our_proj[:, -4:], q_proj[:, -4:]), "columns past q must stay"
    assert torch.equal(our_proj[:, :nope], q_proj[:, :nope]), "q's nope dims must stay"
    if cache_dtype == torch.float8_e4m3fn:  # one e4m3 step apart at most where fp32 sums round differently
        diff = (our_cache.float() - ref_cache.float()).abs()
        assert (diff <= 0.0625 * ref_cache.float().abs().clamp(min=1)).all()
    else:
        torch.testing.assert_close(our_cache.float(), ref_cache.float(), rtol=tol, atol=tol)
    assert our_cache.view(-1, lat + rope)[[1, 2, 3]].float().abs().sum() == 0, "only the given slots are written"


def test_expand_threshold_follows_the_measured_crossover_by_head_count() -> None:
    """DeepSeek layers take the crossover measured for the nearest head count (log scale): V3's 128 heads expand
    from 256 queries, V2-Lite's 16 from 512; a tensor-parallel rank's share picks its nearest measurement."""
    from pagoda.kernels.mla import EXPAND_CROSSOVER, expand_min_query_len

    assert expand_min_query_len(128) == EXPAND_CROSSOVER[128]
    assert expand_min_query_len(16) == EXPAND_CROSSOVER[16]
    assert expand_min_query_len(64) == EXPAND_CROSSOVER[128]  # log2 distance 1 vs 2
    assert expand_min_query_len(8) == EXPAND_CROSSOVER[16]
    assert EXPAND_CROSSOVER[16] > EXPAND_CROSSOVER[128], "fewer heads: the expansion costs more per query saved"
