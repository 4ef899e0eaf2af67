"""Triton kernels against their PyTorch references: CPU interpreter in fp32/fp16; gpu-marked cases in bf16/fp16."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.activation import silu_and_mul
from pagoda.kernels.kv_cache import write_kv
from pagoda.kernels.norm import add_rms_norm, rms_norm
from pagoda.kernels.paged_attention import AttentionConfig, paged_attention, pick_config, pick_num_splits
from pagoda.kernels.rope import apply_rope

# The small cases run in Triton's interpreter on a machine without CUDA, and on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), pytest.param(torch.float16, marks=pytest.mark.gpu)]
# (atol, rtol) for elementwise kernels vs the reference in the same dtype: a couple of ulps of the output dtype.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# max abs error of attention (unit-scale outputs) vs the reference in fp32 on the same inputs.
ATTENTION_ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Fresh random inputs for every case, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# --------------------------------------------------------------------------------------------- paged attention


@dataclass(frozen=True)
class AttentionCase:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    config: AttentionConfig | None = None
    num_pad_seqs: int = 0  # CUDA-graph filler sequences after the real ones: seq_len 0, one query row each
    pad_tokens: int = 0  # rows of q past query_start_loc[B]


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, heads, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D], NaN wherever no real token lives
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled blocks, spare entries -> all-NaN blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_real_tokens: int  # rows [0, num_real_tokens) belong to real sequences


def make_paged_batch(case: AttentionCase, dtype: torch.dtype, device: str) -> PagedBatch:
    """Random q and caches; blocks of each sequence drawn from a shuffled pool; every slot that holds no real
    token is NaN, so a kernel that reads past a sequence's length produces NaN."""
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    seq_lens = list(case.seq_lens) + [0] * case.num_pad_seqs
    query_lens = list(case.query_lens) + [1] * case.num_pad_seqs
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_spare = 3
    num_blocks = sum(blocks_per_seq) + num_spare
    pool = torch.randperm(num_blocks).tolist()
    spare = pool[:num_spare]
    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=torch.float32)  # [N, bs, kvh, D]
    v_cache = k_cache.clone()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.tensor(spare[:1] * (len(seq_lens) * max_blocks), dtype=torch.int32).view(len(seq_lens), -1)
    next_block = num_spare
    for b, (seq_len, num_seq_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        for j in range(num_seq_blocks):
            block = pool[next_block]
            next_block += 1
            block_tables[b, j] = block
            rows = min(bs, seq_len - j * bs)
            k_cache[block, :rows] = torch.randn(rows, kvh, d)
            v_cache[block, :rows] = torch.randn(rows, kvh, d)
    num_real_tokens = sum(case.query_lens)
    num_tokens = sum(query_lens) + case.pad_tokens
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return PagedBatch(
        q=torch.randn(num_tokens, case.num_heads, d).to(device=device, dtype=dtype),
        k_cache=k_cache.to(device=device, dtype=dtype), v_cache=v_cache.to(device=device, dtype=dtype),
        block_tables=block_tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device), num_real_tokens=num_real_tokens)


def reference_attention(batch: PagedBatch, case: AttentionCase, scale: float) -> torch.Tensor:
    """The reference in fp32 on the real sequences, NaN poison zeroed (its decode path reads whole blocks)."""
    num_real = len(case.query_lens)
    return ref.paged_attention(batch.q[:batch.num_real_tokens].float(), batch.k_cache.float().nan_to_num(),
                               batch.v_cache.float().nan_to_num(), batch.block_tables[:num_real],
                               list(case.seq_lens), list(case.query_lens), scale)  # [T_real, heads, D]


def run_attention(case: AttentionCase, dtype: torch.dtype, device: str, atol: float) -> None:
    batch = make_paged_batch(case, dtype, device)
    scale = case.head_dim ** -0.5
    out = torch.full_like(batch.q, float("nan"))  # [T, heads, D] poison: catches rows never written
    max_query_len = max(case.query_lens + ((1,) if case.num_pad_seqs else ()))
    result = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                             batch.query_start_loc, max_query_len, max(case.seq_lens), scale, out=out,
                             config=case.config)
    assert result is out
    expected = reference_attention(batch, case, scale)
    real = out[:batch.num_real_tokens].float()
    assert not real.isnan().any(), "rows of real sequences left unwritten or NaN"
    err = (real - expected).abs().max().item()
    assert err < atol, f"max abs err {err:.3e} >= {atol:.1e}"
    padding = out[batch.num_real_tokens:]
    assert bool((padding == 0).all()), "padding rows must come out exactly zero"


SMALL_TILES = AttentionConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16)


def small_tiles(num_splits: int) -> AttentionConfig:
    return replace(SMALL_TILES, num_splits=num_splits)


SMALL_ATTENTION_CASES = {
    # decode rows, a chunk without prefix, chunks with cached prefixes, a 1-token sequence
    "mixed": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50)),
    # BLOCK_Q = 8 query tokens per tile: several query tiles and key tiles per sequence, masked and unmasked
    "mixed-small-tiles": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), config=SMALL_TILES),
    "prefill-only": AttentionCase((23, 16, 7), (23, 16, 7), config=SMALL_TILES),
    # G = 3 (non power of two), head_dim 24 (padded to 32), block_size 8 (a tile spans two blocks)
    "gqa3-d24-bs8": AttentionCase((3, 1, 12), (30, 7, 12), num_heads=6, num_kv_heads=2, head_dim=24, block_size=8),
    # plain multi-head, head_dim 8 (padded to 16), tiny blocks
    "mha-d8-bs4": AttentionCase((2, 1, 6), (9, 3, 14), num_heads=3, num_kv_heads=3, head_dim=8, block_size=4,
                                config=SMALL_TILES),
    # G = 8 query heads per kv head; a 16-key tile inside a 32-slot block
    "g8-bs32": AttentionCase((1, 4, 1), (45, 20, 33), num_heads=8, num_kv_heads=1, block_size=32,
                             config=SMALL_TILES),
    "decode": AttentionCase((1, 1, 1, 1), (70, 5, 129, 16)),
    "decode-split3": AttentionCase((1, 1, 1), (70, 5, 129), config=small_tiles(3)),
    # more splits than key tiles: some splits are empty
    "decode-split2-short": AttentionCase((1, 1), (20, 1), config=small_tiles(2)),
    "decode-graph-padding": AttentionCase((1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3),
    "decode-graph-padding-split2": AttentionCase((1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3,
                                                 config=small_tiles(2)),
    "prefill-padding-tail": AttentionCase((1, 6, 3), (20, 6, 19), pad_tokens=5, config=SMALL_TILES),
    # split-KV over query tiles longer than 1 (the kernel allows it, though pick_config never chooses it)
    "prefill-split2": AttentionCase((1, 9, 5), (37, 9, 40), config=small_tiles(2)),
    "mixed-graph-padding-split2": AttentionCase((1, 6, 3), (20, 6, 19), num_pad_seqs=1, pad_tokens=4,
                                                config=small_tiles(2)),
    # a sequence with no query rows this step owns no output row and must not disturb its neighbours
    "empty-query-seq": AttentionCase((1, 0, 4, 1), (10, 5, 8, 3), config=SMALL_TILES),
    # kv heads on grid axis 0: decode, tiled chunks, padding and splits address the same rows
    "heads-fast-mixed": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), pad_tokens=3,
                                      config=replace(SMALL_TILES, heads_fast=True)),
    # two key tiles an iteration of the decode loop (decode_unroll): odd and even tile counts, splits, padding
    "decode-unroll2-split2": AttentionCase((1, 1, 1, 1), (70, 5, 129, 16), num_pad_seqs=2, pad_tokens=3,
                                           config=replace(small_tiles(2), decode_unroll=2)),
    "mixed-unroll3": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), config=replace(SMALL_TILES, decode_unroll=3)),
    # every decode tile in one masked loop (decode_one_loop): whole and partial tiles, splits, padding, chunks beside
    "decode-one-loop-split2": AttentionCase((1, 1, 1, 1, 1), (70, 5, 129, 16, 64), num_pad_seqs=2, pad_tokens=3,
                                            config=replace(small_tiles(2), decode_one_loop=True)),
    "mixed-one-loop": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50),
                                    config=replace(SMALL_TILES, decode_one_loop=True)),
    # one stage and a register cap (decode_num_stages=1, decode_max_regs: more programs an SM), split, padding
    "decode-one-stage-capped-split2": AttentionCase(
        (1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3,
        config=replace(small_tiles(2), decode_num_stages=1, decode_max_regs=96, heads_fast=True)),
    # one-warp programs on 16-key tiles (an AttentionConfig choice, not pick_config's), with graph padding
    "decode-one-warp": AttentionCase((1, 1, 1, 1), (70, 5, 129, 16), num_pad_seqs=2, pad_tokens=3,
                                     config=AttentionConfig(decode_tile_n=16, decode_num_warps=1, heads_fast=True)),
    "heads-fast-decode-split2": AttentionCase((1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3,
                                              config=replace(small_tiles(2), heads_fast=True)),
    # softmax sums per key slot (decode_lazy_sum), keys on N or on M, split or not, beside chunks and padding
    "lazy-sum-mixed": AttentionCase((1, 9, 5, 1, 17), (37, 9, 40, 1, 50), pad_tokens=3,
                                    config=replace(SMALL_TILES, decode_lazy_sum=True)),
    "lazy-sum-decode-split2-keys-on-m": AttentionCase((1, 1, 1), (33, 2, 17), num_pad_seqs=2, pad_tokens=3,
                                                      config=replace(small_tiles(2), decode_lazy_sum=True,
                                                                     decode_keys_on_m=True)),
}


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SMALL_ATTENTION_CASES))
def test_paged_attention_matches_reference(name: str, dtype: torch.dtype) -> None:
    run_attention(SMALL_ATTENTION_CASES[name], dtype, DEVICE, ATTENTION_ATOL[dtype])


def _random_gpu_case(num_heads: int, num_kv_heads: int) -> AttentionCase:
    """64 sequences: 48 decode rows with contexts up to 4k, 16 prefill chunks of up to 512 over prefixes."""
    gen = torch.Generator().manual_seed(num_heads * 1000 + num_kv_heads)
    query_lens, seq_lens = [], []
    for b in range(64):
        if b % 4 == 3:
            query_len = int(torch.randint(2, 513, (1,), generator=gen))
            prefix = 0 if b % 8 == 3 else int(torch.randint(0, 3584, (1,), generator=gen))
        else:
            query_len, prefix = 1, int(torch.randint(0, 4096, (1,), generator=gen))
        query_lens.append(query_len)
        seq_lens.append(prefix + query_len)
    return AttentionCase(tuple(query_lens), tuple(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=128)


GPU_ATTENTION_CASES = {
    "llama3-8b-mixed": _random_gpu_case(32, 8),
    "qwen3-0.6b-mixed": _random_gpu_case(16, 8),
    "decode-64": AttentionCase((1,) * 64, tuple(range(63, 4096, 64)), num_heads=32, num_kv_heads=8, head_dim=128),
    # few long sequences: the default config picks split-KV here
    "decode-4-long-split": AttentionCase((1,) * 4, (4096, 3001, 17, 2048), num_heads=32, num_kv_heads=8,
                                         head_dim=128),
    "decode-graph-padding": AttentionCase((1,) * 5, (4096, 100, 1, 777, 2048), num_heads=16, num_kv_heads=8,
                                          head_dim=128, num_pad_seqs=3, pad_tokens=8),
    # pick_config's own launch at a large batch, with graph padding
    "llama3-decode-256-default": AttentionCase((1,) * 256, tuple(range(1000, 1256)), num_heads=32, num_kv_heads=8,
                                               head_dim=128, num_pad_seqs=2, pad_tokens=4),
    "qwen3-decode-256-heads-fast": AttentionCase((1,) * 256, tuple(range(512, 768)), num_heads=16, num_kv_heads=8,
                                                 head_dim=128, config=AttentionConfig(heads_fast=True)),
    "prefill-512x8": AttentionCase((512,) * 8, (512, 1024, 4096, 512, 600, 2000, 513, 3000), num_heads=32,
                                   num_kv_heads=8, head_dim=128),
}


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GPU_ATTENTION_CASES))
def test_paged_attention_matches_reference_gpu(name: str, dtype: torch.dtype) -> None:
    run_attention(GPU_ATTENTION_CASES[name], dtype, "cuda", ATTENTION_ATOL[dtype])


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph() -> None:
    """write_kv + paged_attention captured once, as the worker's decode graphs are, then replayed with new tokens
    and shorter lengths written into the same tensors. max_seq_len = 4096 (a fixed upper bound) picks split-KV."""
    case = AttentionCase((1,) * 6, (100, 2000, 1, 517, 3000, 64), num_heads=32, num_kv_heads=8, head_dim=128,
                         num_pad_seqs=2)
    batch = make_paged_batch(case, torch.bfloat16, "cuda")
    num_tokens, _, head_dim = batch.q.shape
    scale = head_dim ** -0.5
    new_k = torch.empty(num_tokens, case.num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    new_v = torch.empty_like(new_k)  # [T, kv_heads, D]
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda")  # padding rows stay -1
    out = torch.empty_like(batch.q)  # [T, heads, D]

    def step() -> None:
        write_kv(new_k, new_v, batch.k_cache, batch.v_cache, slot_mapping)
        paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, 1, 4096, scale, out=out)

    def load(seq_lens: tuple[int, ...]) -> None:
        """This step's tokens: sequence b's new token is its last, at position seq_lens[b] - 1."""
        for b, seq_len in enumerate(seq_lens):
            block = int(batch.block_tables[b, (seq_len - 1) // case.block_size])
            slot_mapping[b] = block * case.block_size + (seq_len - 1) % case.block_size
        batch.seq_lens[:len(seq_lens)] = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        batch.q.copy_(torch.randn_like(batch.q))
        new_k.copy_(torch.randn_like(new_k))
        new_v.copy_(torch.randn_like(new_v))

    load(case.seq_lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seq_lens in (case.seq_lens, (77, 1500, 1, 16, 2999, 3)):
        load(seq_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference_attention(batch, replace(case, seq_lens=seq_lens), scale)
        err = (out[:batch.num_real_tokens].float() - expected).abs().max().item()
        assert err < ATTENTION_ATOL[torch.bfloat16], f"max abs err {err:.3e}"
        assert bool((out[batch.num_real_tokens:] == 0).all())


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Textbook oracle for one sequence: q [Q, heads, D] are the last Q of the L tokens of k, v [L, kv_heads, D];
    explicit GQA head mapping, causal mask, softmax. Returns [Q, heads, D]."""
    num_queries, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty_like(q)  # [Q, heads, D]
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        scores = q[:, h] @ k[:, kv].T * scale  # [Q, L]
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)[:, None]  # [Q, 1]
        scores = scores.masked_fill(torch.arange(seq_len, device=q.device)[None, :] > query_pos, float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, kv]
    return out


def test_reference_and_kernel_match_dense_oracle() -> None:
    """The reference itself is right: fp64 dense causal attention over the unpaged K/V agrees with it (fp64)
    and with the kernel (fp32)."""
    case = AttentionCase((1, 6, 4, 1), (19, 6, 27, 40), num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    batch = make_paged_batch(case, torch.float32, DEVICE)
    scale = 0.3
    k64, v64 = batch.k_cache.double(), batch.v_cache.double()
    q64 = batch.q.double()
    oracle = torch.empty_like(q64)  # [T, heads, D]
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(case.seq_lens):
        k = ref.gather_kv(k64, batch.block_tables[b], seq_len)  # [L, kv_heads, D]
        v = ref.gather_kv(v64, batch.block_tables[b], seq_len)
        oracle[starts[b]:starts[b + 1]] = dense_causal_attention(q64[starts[b]:starts[b + 1]], k, v, scale)
    reference = ref.paged_attention(q64, k64.nan_to_num(), v64.nan_to_num(), batch.block_tables,
                                    list(case.seq_lens), list(case.query_lens), scale)
    torch.testing.assert_close(reference, oracle, atol=1e-10, rtol=1e-10)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                          batch.query_start_loc, max(case.query_lens), max(case.seq_lens), scale,
                          config=SMALL_TILES)
    assert (out.double() - oracle).abs().max().item() < 1e-5


def test_paged_attention_strided_q_and_reused_launch_shape() -> None:
    """q as a view of a fused qkv buffer; one launch shape (picked from upper bounds, as for a CUDA graph) stays
    right when the lengths in the tensors change under it."""
    case = AttentionCase((1, 1, 1), (40, 3, 17))
    batch = make_paged_batch(case, torch.float32, DEVICE)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, device=DEVICE)  # [T, (heads + 2 kv_heads) * D]
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided rows
    q.copy_(batch.q)
    config = pick_config(num_tokens, 3, case.num_kv_heads, 2, max_query_len=1, max_seq_len=4096)
    for seq_lens in ((40, 3, 17), (25, 1, 9)):  # shorter lengths written into the same tensor
        batch.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))
        out = paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 1, 4096, 0.2, config=config)
        expected = reference_attention(batch, replace(case, seq_lens=seq_lens), 0.2)
        assert (out - expected).abs().max().item() < 2e-5


def test_pick_config_decode_launches() -> None:
    """Decode-only batches: 64-key tiles and 4 warps over a 16-bit cache at any size (one-warp programs lost at long
    contexts, bench/results/s22); over an fp8 cache QK^T on the fp8 tensor cores, keys on M, sums per key slot, and
    one stage where the launch is split (small batches); split launches run every tile in one masked loop
    (bench/results/s23)."""
    for num_seqs in (1, 4, 64, 256, 1024):
        bf16 = pick_config(num_seqs, num_seqs, 8, 4, 1, 4096)
        assert (bf16.decode_num_warps, bf16.decode_tile_n, bf16.decode_lazy_sum) == (4, 64, False)
        assert bf16.decode_num_stages == 2
        fp8 = pick_config(num_seqs, num_seqs, 8, 4, 1, 4096, fp8_kv=True)
        assert (fp8.fp8_convert, fp8.decode_keys_on_m, fp8.decode_lazy_sum) == ("qk_fp8x2", True, True)
        split = num_seqs < 16
        assert (fp8.num_splits > 1, bf16.num_splits > 1) == (split, split)
        assert fp8.decode_num_stages == (1 if split else 2)
        assert fp8.decode_one_loop == bf16.decode_one_loop == split
    for chunks in ((256 + 512, 257, 8, 4, 512, 4096), (4 * 64, 4, 8, 4, 64, 1088), (124 + 2048, 128, 8, 4, 512, 1536)):
        mixed = pick_config(*chunks, fp8_kv=True)  # steps with chunks: the decode rows keep the decode-only launch
        assert (mixed.fp8_convert, mixed.decode_fp8_convert, mixed.decode_keys_on_m, mixed.decode_lazy_sum) == (
            "f16_words", "qk_fp8x2", True, True), chunks
        assert pick_config(*chunks).decode_fp8_convert == ""


def test_attention_config_register_caps_are_checked() -> None:
    case = AttentionCase((1,), (5,))
    batch = make_paged_batch(case, torch.float32, DEVICE)
    for field, value in (("decode_max_regs", 16), ("decode_max_regs", 300), ("prefill_max_regs", 8)):
        with pytest.raises(ValueError, match=field):
            paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, 1, 5, 0.2, config=replace(SMALL_TILES, **{field: value}))


def test_pick_num_splits_depends_on_host_shape_only() -> None:
    assert pick_num_splits(256, 8, 1, 4096) == 1  # enough programs already
    assert pick_num_splits(4, 8, 7, 4096) == 1  # prefill never splits
    assert pick_num_splits(1, 8, 1, 64) == 1  # one key tile: nothing to split
    assert pick_num_splits(1, 8, 1, 4096) == 64  # one sequence: 8 kv heads x 64 splits
    assert pick_num_splits(1, 8, 1, 1024) == 16  # at least one 64-key tile a split
    assert 1 < pick_num_splits(8, 8, 1, 4096) < 16
    every = {pick_num_splits(b, h, 1, n, sms) for b in range(1, 40) for h in (1, 2, 8) for n in range(1, 5000, 37)
             for sms in (78, 132)}
    assert every == {1, 2, 4, 8, 16, 32, 64}  # powers of two only: the warm-up compiles each decode variant
    assert pick_num_splits(2, 8, 1, 32768) == pick_num_splits(2, 8, 1, 32768)


def test_paged_attention_rejects_bad_inputs() -> None:
    batch = make_paged_batch(AttentionCase((1, 2), (5, 6)), torch.float32, DEVICE)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
                seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc, max_query_len=2, max_seq_len=6,
                scale=0.1)
    bad = {
        "q": batch.q[..., :16],  # head_dim differs from the cache
        "k_cache": batch.k_cache.half(),  # dtype differs from q
        "v_cache": batch.v_cache[:, :, :1],  # shape differs from k_cache
        "block_tables": batch.block_tables.float(),
        "seq_lens": batch.seq_lens[:1],
        "query_start_loc": batch.query_start_loc.long()[:2],
    }
    for name, value in bad.items():
        with pytest.raises(ValueError):
            paged_attention(**{**args, name: value})
    with pytest.raises(ValueError):
        paged_attention(**args, out=torch.empty(3, 4, 16))
    with pytest.raises(ValueError):
        paged_attention(**args, config=AttentionConfig(decode_tile_n=24))
    with pytest.raises(ValueError, match="heads"):
        paged_attention(**{**args, "q": torch.randn(3, 3, 32)})  # 3 heads over 2 kv heads


# --------------------------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 2, 32, 16, 5), (5, 3, 24, 8, 4), (3, 1, 256, 4, 3), (1, 8, 128, 16, 2)],
                         ids=lambda s: "T{}-kvh{}-d{}-bs{}-n{}".format(*s))
def test_write_kv_matches_reference(shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
    check_write_kv(shape, dtype, dtype, DEVICE)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_write_kv_matches_reference_gpu(dtype: torch.dtype) -> None:
    check_write_kv((4096, 8, 128, 16, 400), dtype, dtype, "cuda")


def test_write_kv_casts_to_cache_dtype() -> None:
    check_write_kv((6, 2, 16, 4, 3), torch.float32, torch.float16, DEVICE)


def check_write_kv(shape: tuple[int, int, int, int, int], dtype: torch.dtype, cache_dtype: torch.dtype,
                   device: str) -> None:
    num_tokens, kvh, d, bs, num_blocks = shape
    assert num_tokens <= num_blocks * bs
    # k, v as strided views of one fused buffer, as the model's qkv split makes them
    kv = torch.randn(num_tokens, 2 * kvh * d + 3, device=device).to(dtype)  # [T, 2 * kvh * D + pad]
    k = kv[:, :kvh * d].view(num_tokens, kvh, d)
    v = kv[:, kvh * d:2 * kvh * d].view(num_tokens, kvh, d)
    slot_mapping = torch.randperm(num_blocks * bs, device=device)[:num_tokens]  # [T] int64, distinct slots
    slot_mapping[torch.rand(num_tokens, device=device) < 0.3] = -1  # padding rows
    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=cache_dtype, device=device)  # poison
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, expected_k, expected_v, slot_mapping)
    write_kv(k, v, k_cache, v_cache, slot_mapping.int() if num_tokens % 2 else slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


def test_write_kv_rejects_bad_inputs() -> None:
    k = torch.randn(4, 2, 16)
    cache = torch.zeros(3, 4, 2, 16)
    slots = torch.arange(4)
    with pytest.raises(ValueError):
        write_kv(k, k[:, :1], cache, cache, slots)
    with pytest.raises(ValueError):
        write_kv(k, k, cache[:, :, :1], cache[:, :, :1], slots)
    with pytest.raises(ValueError):
        write_kv(k, k, cache, cache, slots.float())
    with pytest.raises(ValueError):
        write_kv(k, k, cache, cache, slots[:3])
    with pytest.raises(ValueError):
        write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, cache, slots)


# --------------------------------------------------------------------------------------------- norms


NORM_SHAPES = [(1, 8), (7, 100), (5, 1024), (3, 4, 24), (2, 3, 128)]


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: str, with_residual: bool) -> None:
    atol, rtol = ELEMENTWISE_TOL[dtype]
    n = shape[-1]
    # a strided input: the leading dims of a wider buffer (as q/k heads of a fused qkv for per-head norms)
    buffer = torch.randn(*shape[:-1], n + 5, device=device).to(dtype)
    x = buffer[..., :n]
    weight = (1 + 0.1 * torch.randn(n, device=device)).to(dtype)  # [N]
    eps = 1e-6
    if not with_residual:
        out = torch.full(shape, float("nan"), dtype=dtype, device=device)  # poison
        assert rms_norm(x, weight, eps, out=out) is out
        torch.testing.assert_close(out, ref.rms_norm(x, weight, eps), atol=atol, rtol=rtol)
        return
    residual = torch.randn(shape, device=device).to(dtype)
    normed, summed = add_rms_norm(x, residual, weight, eps)
    expected_normed, expected_summed = ref.add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)  # the add rounds exactly as torch's
    torch.testing.assert_close(normed, expected_normed, atol=atol, rtol=rtol)


@pytest.mark.parametrize("with_residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(shape, dtype, DEVICE, with_residual)


@pytest.mark.parametrize("with_residual", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(512, 1024), (256, 4096), (33, 8192), (300, 32, 128), (7, 5000)], ids=str)
def test_rms_norm_matches_reference_gpu(shape: tuple[int, ...], dtype: torch.dtype, with_residual: bool) -> None:
    check_rms_norm(shape, dtype, "cuda", with_residual)


def test_add_rms_norm_without_residual_returns_input() -> None:
    x = torch.randn(3, 16, device=DEVICE)
    weight = torch.rand(16, device=DEVICE)
    normed, summed = add_rms_norm(x, None, weight, 1e-5)
    assert summed is x
    torch.testing.assert_close(normed, ref.rms_norm(x, weight, 1e-5))


def test_rms_norm_rejects_bad_inputs() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(16, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x.T, torch.ones(4), 1e-6)  # last dim not contiguous
    with pytest.raises(ValueError):
        add_rms_norm(x, torch.randn(4, 8), torch.ones(16), 1e-6)


# --------------------------------------------------------------------------------------------- rope


def check_rope(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
               mode: str) -> None:
    atol, rtol = ELEMENTWISE_TOL[dtype]
    # q, k as strided views of a fused qkv buffer
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # [T, heads, D]
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))  # [D / 2]
    positions = torch.randint(0, 4096, (num_tokens,), device=device)  # [T]
    cos, sin = ref.rope_cos_sin(inv_freq, positions, dtype)  # [T, D] each
    expected_q, expected_k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    if mode == "per-token":
        q_out, k_out = apply_rope(q, k, cos, sin)
    elif mode == "positions":
        cos_cache, sin_cache = ref.rope_cos_sin(inv_freq, torch.arange(4096, device=device), dtype)  # [4096, D]
        q_out, k_out = apply_rope(q, k, cos_cache, sin_cache, positions=positions)
    else:  # in place, straight into the qkv buffer
        q_out, k_out = apply_rope(q, k, cos, sin, inplace=True)
        assert q_out is q and k_out is k
    if device == "cuda" and dtype == torch.bfloat16:
        # Bit for bit, as transformers computes it: one flipped ulp per layer is enough to change greedy tokens.
        atol, rtol = 0.0, 0.0
    torch.testing.assert_close(q_out, expected_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out, expected_k, atol=atol, rtol=rtol)


@pytest.mark.parametrize("mode", ["per-token", "positions", "inplace"])
@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 4, 2, 32), (3, 3, 1, 24), (1, 6, 6, 6), (9, 16, 8, 128)], ids=str)
def test_rope_matches_reference(shape: tuple[int, int, int, int], dtype: torch.dtype, mode: str) -> None:
    check_rope(*shape, dtype, DEVICE, mode)


@pytest.mark.parametrize("mode", ["per-token", "positions", "inplace"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2048, 32, 8, 128), (333, 16, 8, 128), (64, 14, 2, 64)], ids=str)
def test_rope_matches_reference_gpu(shape: tuple[int, int, int, int], dtype: torch.dtype, mode: str) -> None:
    check_rope(*shape, dtype, "cuda", mode)


def test_rope_rejects_bad_inputs() -> None:
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cos = torch.randn(3, 8)
    with pytest.raises(ValueError):
        apply_rope(q, k, cos[:2], cos[:2])
    with pytest.raises(ValueError):
        apply_rope(q[..., :7], k[..., :7], cos[:, :7], cos[:, :7])  # odd head_dim
    with pytest.raises(ValueError):
        apply_rope(q, k, cos, cos, positions=torch.zeros(3))  # float positions
    with pytest.raises(ValueError):
        apply_rope(q, k.half(), cos, cos)


# --------------------------------------------------------------------------------------------- silu_and_mul


def check_silu_and_mul(num_tokens: int, inter_size: int, dtype: torch.dtype, device: str) -> None:
    atol, rtol = ELEMENTWISE_TOL[dtype]
    x = (2 * torch.randn(num_tokens, 2 * inter_size, device=device)).to(dtype)  # [T, 2I]
    out = torch.full((num_tokens, inter_size), float("nan"), dtype=dtype, device=device)  # poison
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, ref.silu_and_mul(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 100), (4, 1500)], ids=str)
def test_silu_and_mul_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    check_silu_and_mul(*shape, dtype, DEVICE)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(256, 14336), (1024, 3072), (3, 77)], ids=str)
def test_silu_and_mul_matches_reference_gpu(shape: tuple[int, int], dtype: torch.dtype) -> None:
    check_silu_and_mul(*shape, dtype, "cuda")


def test_silu_and_mul_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(3, 5))
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(6, 4).T)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(3, 4), out=torch.empty(3, 3))
