"""Paged attention over a bf16 vs an fp8 (e4m3) KV cache, one layer, on one GPU: every fp8 variant (the old path
that converts K/V to bf16, fp16 dots by cvt, K/V as int32 words converted before the dots, 64/128-key decode tiles,
2 or 3 stages) is checked against the PyTorch reference, then timed from a CUDA graph of back-to-back launches that
cycle through copies of the batch in disjoint cache blocks (>= 512 MB of KV a cycle, so no launch finds its KV in
the 50 MB L2, as in a decode step's 28+ layers; no host launch gaps), at qwen3-0.6b (16 q / 8 kv heads) and
llama3-8b (32 / 8) shapes, head_dim 128, B = 64 and 256 decode rows over contexts 512-768 (the reference
workload's spread) and 1024; plus chunks of 512 queries against 1024 cached tokens (prefill against cached
context), 4 x 64 over 1024 cached, and 4 x 512 beside 124 decode rows. TB/s counts the KV bytes read in the cache's
dtype. About a minute on an H200.

    python -m pagoda.bench.kv_fp8_bench [--quick] [--long] [--chunks-only] [--only PREFIX,...] [--out FILE]
    (JSON to $OUT/kv_fp8_bench.json if OUT). First, per model, an accuracy table of every fp8 decode variant for a
    normal q and a q with a few large channels.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.report import write_report
from pagoda.kernels import paged_attention as pa
from pagoda.kernels import reference as ref
from pagoda.kernels.kv_cache import dequantize_blocks

DEVICE = "cuda"
BLOCK_SIZE = 16
HEAD_DIM = 128
MODELS = {"qwen3-0.6b": (16, 8), "llama3-8b": (32, 8)}  # (q heads, kv heads)
BATCHES = (64, 256)
CONTEXTS = ((512, 768), (1024, 1024))  # (shortest, longest) context of the batch
LONG_BATCHES, LONG_CONTEXTS = (1, 64, 256), ((512, 768), (1024, 1024), (4096, 4096))  # --long
CYCLE_BYTES = 512 << 20  # KV bytes (in bf16) a timed cycle reads at least: 10x the L2
CHECK_MAX_TOKENS = 64 * 4096  # reference check where B x context is at most this (its fp32 gather is big)
TOLERANCE = 2e-2  # max abs error / max |reference|: bf16 output rounding plus 16-bit operands
# "qk_fp8" rounds q to e4m3 (3 mantissa bits): each score moves by ~2^-4 / sqrt(3) = 3.6% rms of its own spread,
# and the output's max error relative to its amax follows (CPU interpreter, qwen3-0.6b heads, B=2-4, ctx 100-300,
# unit q/K/V: 2.5e-2 to 3.2e-2 with a normal q, 2.8e-2 and 5.0e-2 with 4 channels 10x and 30x larger; f16_words
# 3.4e-3 to 5.0e-3). About twice the largest, as the max over B=64 rows x heads runs further into the tail.
QK_FP8_TOLERANCE = 1e-1
OUTLIER_CHANNELS, OUTLIER_GAIN = 4, 30.0  # the accuracy table's second q: a few channels far larger, as real q has


@dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool
    changes: dict[str, Any]  # AttentionConfig fields replaced in pick_config's choice
    # fp8 cache read another way: every block the batch references dequantized once into a bf16 scratch
    # (kv_cache.dequantize_blocks), then the bf16 kernel and launch shapes over the scratch; timed together
    dequant: bool = False


DECODE_VARIANTS = (
    Variant("bf16", False, {}),
    Variant("fp8_old", True, {"fp8_convert": "native", "decode_tile_n": 64}),  # the path before issue 25 item 5
    Variant("fp8_f16_t64", True, {"fp8_convert": "f16", "decode_tile_n": 64}),
    Variant("fp8_f16_t128", True, {"fp8_convert": "f16", "decode_tile_n": 128}),  # default until f16_words
    Variant("fp8_words_t64", True, {"fp8_convert": "f16_words", "decode_tile_n": 64}),
    Variant("fp8_words_t128", True, {"fp8_convert": "f16_words", "decode_tile_n": 128}),
    Variant("fp8_words_t128_s3", True, {"fp8_convert": "f16_words", "decode_tile_n": 128, "decode_num_stages": 3}),
    Variant("fp8_words_t64_s3", True, {"fp8_convert": "f16_words", "decode_tile_n": 64, "decode_num_stages": 3}),
    Variant("fp8_vwords_t128", True, {"fp8_convert": "f16_vwords", "decode_tile_n": 128}),
    # transposed decode dots: keys on M (Hopper wgmma, 64-row multiples), query heads on N
    Variant("fp8_words_t64_kom", True, {"fp8_convert": "f16_words", "decode_tile_n": 64, "decode_keys_on_m": True}),
    Variant("fp8_words_t128_kom", True, {"fp8_convert": "f16_words", "decode_tile_n": 128,
                                         "decode_keys_on_m": True}),
    Variant("bf16_kom", False, {"decode_keys_on_m": True}),
    # QK^T on fp8 tensor cores (e4m3 q with per-row scales x the K tile as loaded); only with keys on M do the
    # decode dots become wgmma (QGMMA.64x16x32.E4M3), with 16 query rows on M Triton upcasts K for mma.sync
    Variant("fp8_qk_t64", True, {"fp8_convert": "qk_fp8", "decode_tile_n": 64, "decode_keys_on_m": True}),
    Variant("fp8_qk_t128", True, {"fp8_convert": "qk_fp8", "decode_tile_n": 128, "decode_keys_on_m": True}),
    Variant("fp8_qk_t64_mrows", True, {"fp8_convert": "qk_fp8", "decode_tile_n": 64}),
    # q as two e4m3 terms (hi + its rounding error), two fp8 dots a K tile: a 16-bit q's accuracy (sm_90 SASS, 64-key
    # tiles, keys on M: 394 loop instructions against qk_fp8's 365 and f16_words' 487; pick_config's decode default
    # since the H200 timing of 2026-12-03, bench/results/s19)
    Variant("fp8_qk2_t64", True, {"fp8_convert": "qk_fp8x2", "decode_tile_n": 64, "decode_keys_on_m": True}),
    Variant("fp8_qk2_t128", True, {"fp8_convert": "qk_fp8x2", "decode_tile_n": 128, "decode_keys_on_m": True}),
    Variant("fp8_qk2_hf_t64", True, {"fp8_convert": "qk_fp8x2", "decode_tile_n": 64, "decode_keys_on_m": True,
                                      "heads_fast": True}),
    # and PV too (e4m3 p x V as loaded): V's keys are strided, so Triton transposes the tile through shared memory
    Variant("fp8_qkv_t64", True, {"fp8_convert": "qkv_fp8", "decode_tile_n": 64, "decode_keys_on_m": True}),
    # the conversion pinned in the load's layout: e4m3 tiles by cp.async, then bf16's path into the dots (sm_90
    # SASS: 338 loop instructions a 64-key tile against 487 for f16_words; slower on the H200, seventeenth session:
    # 167-169 us against 151-152)
    Variant("fp8_pinned_t64", True, {"fp8_convert": "f16_pinned", "decode_tile_n": 64}),
    Variant("fp8_pinned_t128", True, {"fp8_convert": "f16_pinned", "decode_tile_n": 128}),
    Variant("fp8_pinned_t64_s3", True, {"fp8_convert": "f16_pinned", "decode_tile_n": 64, "decode_num_stages": 3}),
    Variant("fp8_pinned_t64_kom", True, {"fp8_convert": "f16_pinned", "decode_tile_n": 64, "decode_keys_on_m": True}),
    # the default decode launch (kv heads first on the grid) with more or fewer warps a program (sm_90 SASS, 64-key
    # tiles: 8 warps 74 registers a thread, 3 programs an SM by registers, 155 warp instructions a KB against 119)
    Variant("fp8_hf_w8", True, {"heads_fast": True, "decode_num_warps": 8}),
    Variant("fp8_hf_t128_w8", True, {"heads_fast": True, "decode_tile_n": 128, "decode_num_warps": 8}),
    Variant("fp8_hf_w2", True, {"heads_fast": True, "decode_num_warps": 2}),
    Variant("fp8_hf_t32", True, {"heads_fast": True, "decode_tile_n": 32}),
    # twenty-second session: the decode softmax sums kept per key slot (decode_lazy_sum; sm_90 SASS, qk_fp8x2: 394 ->
    # 354 loop instructions, 8 -> 5 barriers a tile), and programs of one or two warps on 16/32-key tiles (no
    # cross-warp reductions; 8-12 programs an SM instead of 4, so more tiles in flight while others compute)
    Variant("fp8_s22_qk2_lazy", True, {"decode_lazy_sum": True}),
    Variant("fp8_s22_qk2_eager", True, {"decode_lazy_sum": False}),  # the fp8 default before the lazy sums
    Variant("bf16_w4_t64", False, {"decode_tile_n": 64, "decode_num_warps": 4}),  # the bf16 default before one warp
    Variant("fp8_s22_qk2_lazy_s3", True, {"decode_lazy_sum": True, "decode_num_stages": 3}),
    Variant("fp8_s22_words_t64_lazy", True, {"fp8_convert": "f16_words", "decode_keys_on_m": False,
                                             "decode_lazy_sum": True}),
    Variant("fp8_s22_words_t16_w1", True, {"fp8_convert": "f16_words", "decode_keys_on_m": False,
                                           "decode_tile_n": 16, "decode_num_warps": 1}),
    Variant("fp8_s22_words_t16_w1_lazy", True, {"fp8_convert": "f16_words", "decode_keys_on_m": False,
                                                "decode_tile_n": 16, "decode_num_warps": 1, "decode_lazy_sum": True}),
    Variant("fp8_s22_pinned_t16_w1", True, {"fp8_convert": "f16_pinned", "decode_keys_on_m": False,
                                            "decode_tile_n": 16, "decode_num_warps": 1}),
    Variant("fp8_s22_words_t16_w2_lazy", True, {"fp8_convert": "f16_words", "decode_keys_on_m": False,
                                                "decode_tile_n": 16, "decode_num_warps": 2, "decode_lazy_sum": True}),
    Variant("fp8_s22_words_t32_w2_lazy", True, {"fp8_convert": "f16_words", "decode_keys_on_m": False,
                                                "decode_tile_n": 32, "decode_num_warps": 2, "decode_lazy_sum": True}),
    # two key tiles an iteration (decode_unroll): their copies go out together, one wait a pair (sm_90 SASS, fp8
    # default: 801 loop instructions a pair against 354 a tile, 70 KB of shared memory, 3 programs an SM not 4;
    # bf16 would take 184 registers a thread, 2 programs an SM)
    Variant("fp8_s22_qk2_lazy_u2", True, {"decode_lazy_sum": True, "decode_unroll": 2}),
    # more programs an SM (prepared in the twenty-second session, untimed; sm_90 SASS, qwen3-0.6b heads): one stage
    # leaves 22.5 KB of shared memory a program instead of 46 (the pipeliner's second K buffer never overlapped a
    # copy with work: the copies go out at the end of the loop body), 337 loop instructions against 354; with a
    # 96-register cap 5 programs an SM instead of 4 (5 spill instructions in the loop). bf16: the 96-register cap
    # alone gives 5 programs (38 KB a program, 317 loop instructions, no spills in the loop).
    Variant("fp8_s22_s1", True, {"decode_num_stages": 1}),
    Variant("fp8_s22_s1_r96", True, {"decode_num_stages": 1, "decode_max_regs": 96}),
    Variant("bf16_s22_r96", False, {"decode_max_regs": 96}),
    Variant("bf16_s22_t16_w1", False, {"decode_tile_n": 16, "decode_num_warps": 1}),
    Variant("bf16_s22_t32_w2", False, {"decode_tile_n": 32, "decode_num_warps": 2}),
    # twenty-third session: every decode tile in one masked loop (decode_one_loop; sm_90 SASS, qk_fp8x2: one loop of
    # 410 instructions instead of 354 + a 400-instruction loop for the partial tile, whose copies go out only after
    # the first loop ends: a memory round trip a program, exposed at short contexts)
    Variant("fp8_s23_one_loop", True, {"decode_one_loop": True}),
    Variant("fp8_s23_one_loop_s1", True, {"decode_one_loop": True, "decode_num_stages": 1}),
    Variant("bf16_s23_one_loop", False, {"decode_one_loop": True}),
    Variant("fp8_s23_two_loops", True, {"decode_one_loop": False}),
    # twenty-fourth session: the hand-pipelined Gluon kernel (kernels/fp8_decode_gluon.py): a ring of 2-4 e4m3 K/V
    # tiles in shared memory, the next tiles' copies in flight while one computes; as committed, q's two terms packed
    # in one score dot for groups <= 8 (sm_90 SASS, qwen3-0.6b heads, 2 slots: 76 registers, 35 KB, 6 programs an SM).
    # The ring of 2 is pick_config's unsplit default; 3 and 4 were slower (bench/RESULTS.md)
    Variant("fp8_s24_gluon_s2", True, {"decode_pipelined": True, "decode_num_stages": 2}),
    Variant("fp8_s24_gluon_s3", True, {"decode_pipelined": True, "decode_num_stages": 3}),
    Variant("fp8_s24_gluon_s4", True, {"decode_pipelined": True, "decode_num_stages": 4}),
    Variant("fp8_default", True, {}),  # what pick_config chooses for an fp8 cache now
)
_UNSTAGED = {"fp8_q_staged": False, "prefill_max_regs": 0}
CHUNK_VARIANTS = (
    Variant("bf16", False, {}),
    Variant("fp8_old", True, {"fp8_convert": "native", **_UNSTAGED}),
    Variant("fp8_f16", True, {"fp8_convert": "f16"}),
    Variant("fp8_words", True, {"fp8_convert": "f16_words"}),
    Variant("fp8_vwords", True, {"fp8_convert": "f16_vwords"}),
    Variant("fp8_words_t64", True, {"fp8_convert": "f16_words", "prefill_tile_n": 64}),
    Variant("fp8_qk", True, {"fp8_convert": "qk_fp8"}),
    Variant("fp8_qk_t64", True, {"fp8_convert": "qk_fp8", "prefill_tile_n": 64}),
    Variant("fp8_qkv", True, {"fp8_convert": "qkv_fp8"}),
    Variant("fp8_qk2", True, {"fp8_convert": "qk_fp8x2"}),
    # q staged through memory (AttentionConfig.fp8_q_staged) or kept in registers as before, with or without a
    # 128-register cap (two 8-warp programs an SM); "fp8_unstaged_t64" is the chunk default before staging
    Variant("fp8_unstaged_t64", True, {"prefill_tile_n": 64, **_UNSTAGED}),
    Variant("fp8_unstaged_t32", True, {"prefill_tile_n": 32, **_UNSTAGED}),
    Variant("fp8_unstaged_t32_r128", True, {"prefill_tile_n": 32, "fp8_q_staged": False, "prefill_max_regs": 128}),
    Variant("fp8_staged_t32", True, {"prefill_tile_n": 32, "prefill_max_regs": 0}),
    Variant("fp8_staged_t32_r128", True, {"prefill_tile_n": 32, "prefill_max_regs": 128}),
    Variant("fp8_staged_t64_r128", True, {"prefill_tile_n": 64, "prefill_max_regs": 128}),
    Variant("fp8_staged_t32_r128_s2", True, {"prefill_tile_n": 32, "prefill_max_regs": 128,
                                             "prefill_num_stages": 2}),
    # 256-row tiles, 16 warps (one program an SM, 126 registers): each converted K/V tile serves twice the rows
    Variant("bf16_m256", False, {"prefill_block_m": 256, "prefill_num_warps": 16}),
    Variant("fp8_staged_m256", True, {"prefill_block_m": 256, "prefill_num_warps": 16, "prefill_tile_n": 32,
                                      "prefill_max_regs": 0}),
    Variant("fp8_dequant", True, {}, dequant=True),
    Variant("fp8_default", True, {}),
)
# (label, query lengths, seq_lens): chunks over 1024 cached tokens (the 4 x 512 row of issue 25), short chunks (one
# 128-row tile a kv head), and a mostly-decode step (124 decode rows beside 4 chunks: pick_config's 64-row tiles)
CHUNK_SHAPES = (
    ("1024 cached + 512 new", [512] * 4, [1536] * 4),
    ("1024 cached + 64 new", [64] * 4, [1088] * 4),
    ("1024 cached + 512 new, 124 decodes", [512] * 4 + [1] * 124, [1536] * 4 + [1024] * 124),
)


def tolerance(variant: Variant) -> float:
    return QK_FP8_TOLERANCE if variant.changes.get("fp8_convert") in ("qk_fp8", "qkv_fp8") else TOLERANCE


def select(variants: tuple[Variant, ...], prefixes: list[str] | None) -> tuple[Variant, ...]:
    """The variants whose name starts with one of prefixes (all without), bf16 always (the speedup's base)."""
    if not prefixes:
        return variants
    return tuple(v for v in variants if v.name == "bf16" or any(v.name.startswith(p) for p in prefixes))


@dataclass
class Batch:
    q: torch.Tensor  # [T, heads, D] bf16
    caches: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # fp8? -> (k, v) [num_blocks, BLOCK_SIZE, kvh, D]
    scales: tuple[torch.Tensor, torch.Tensor]  # fp8 k_scale, v_scale [1] fp32
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled blocks (copy 0, the one checked)
    copy_tables: list[torch.Tensor]  # per copy of the batch: [B, max_blocks] int32 over its own blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens_host: list[int]
    query_lens_host: list[int]
    dequant_plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # see dequant_plan


def make_batch(num_heads: int, num_kv_heads: int, query_lens: list[int], seq_lens: list[int]) -> Batch:
    """Random bf16 K/V in shuffled blocks, and the same quantized to e4m3 with amax / 448 per-tensor scales; as many
    copies of the batch (same q and lengths, disjoint blocks) as make a timed cycle read >= CYCLE_BYTES."""
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    blocks_per_copy = sum(blocks)
    bf16_bytes = sum(seq_lens) * num_kv_heads * HEAD_DIM * 2 * 2
    copies = max(1, -(-CYCLE_BYTES // bf16_bytes))
    num_blocks = blocks_per_copy * copies
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    k_scale = (k.abs().amax().float() / ref.FP8_MAX).reshape(1)
    v_scale = (v.abs().amax().float() / ref.FP8_MAX).reshape(1)
    order = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    copy_tables = []
    used = 0
    for _ in range(copies):
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)  # [B, max_blocks]
        for b, n in enumerate(blocks):
            tables[b, :n] = order[used:used + n]
            used += n
        copy_tables.append(tables)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return Batch(q=torch.randn(qsl[-1], num_heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16),
                 caches={False: (k, v), True: (ref.quantize_fp8(k, k_scale), ref.quantize_fp8(v, v_scale))},
                 scales=(k_scale, v_scale), block_tables=copy_tables[0], copy_tables=copy_tables,
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                 query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                 seq_lens_host=seq_lens, query_lens_host=query_lens)


def variant_config(batch: Batch, variant: Variant) -> pa.AttentionConfig:
    num_kv_heads = batch.caches[False][0].shape[2]
    fp8_kernel = variant.fp8 and not variant.dequant  # the dequant variant runs the bf16 kernel
    base = pa.pick_config(batch.q.shape[0], len(batch.seq_lens_host), num_kv_heads,
                          batch.q.shape[1] // num_kv_heads, max(batch.query_lens_host), max(batch.seq_lens_host),
                          torch.cuda.get_device_properties(0).multi_processor_count, fp8_kernel)
    return replace(base, **variant.changes)


def dequant_plan(batch: Batch, copy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_ids [n] int32: the blocks copy `copy` of the batch references, sequence by sequence; the block table
    [B, max_blocks] int32 of the scratch that holds them in that order). Built on the host once per copy (first
    call, eager, before any graph capture)."""
    if copy not in batch.dequant_plans:
        tables = batch.copy_tables[copy].cpu()  # [B, max_blocks]
        ids, scratch_table, used = [], torch.zeros_like(tables), 0
        for b, seq_len in enumerate(batch.seq_lens_host):
            n = -(-seq_len // BLOCK_SIZE)
            ids.append(tables[b, :n])
            scratch_table[b, :n] = torch.arange(used, used + n, dtype=torch.int32)
            used += n
        batch.dequant_plans[copy] = (torch.cat(ids).to(DEVICE), scratch_table.to(DEVICE))
    return batch.dequant_plans[copy]


def run_variant(batch: Batch, variant: Variant, config: pa.AttentionConfig, copy: int = 0) -> torch.Tensor:
    k_cache, v_cache = batch.caches[variant.fp8]
    k_scale, v_scale = batch.scales if variant.fp8 else (None, None)
    if variant.dequant:
        block_ids, scratch_table = dequant_plan(batch, copy)
        k_scratch, v_scratch = dequantize_blocks(k_cache, v_cache, k_scale, v_scale, block_ids, batch.q.dtype)
        return pa.paged_attention(batch.q, k_scratch, v_scratch, scratch_table, batch.seq_lens,
                                  batch.query_start_loc, max(batch.query_lens_host), max(batch.seq_lens_host),
                                  HEAD_DIM ** -0.5, config=config)
    return pa.paged_attention(batch.q, k_cache, v_cache, batch.copy_tables[copy], batch.seq_lens,
                              batch.query_start_loc, max(batch.query_lens_host), max(batch.seq_lens_host),
                              HEAD_DIM ** -0.5, config=config, k_scale=k_scale, v_scale=v_scale)


def graph_cycle_us(batch: Batch, variant: Variant, config: pa.AttentionConfig, reps: int) -> float:
    """Median device time of one call, from a CUDA graph that runs the call once per copy of the batch back to
    back (each copy's KV in its own blocks, so every call reads HBM), replayed `reps` times."""
    calls = [partial(run_variant, batch, variant, config, copy) for copy in range(len(batch.copy_tables))]
    return 1e3 * graph_time_ms(calls, reps=reps, replays=1)


def reference(batch: Batch, fp8: bool) -> torch.Tensor:
    k_cache, v_cache = batch.caches[fp8]
    k_scale, v_scale = batch.scales if fp8 else (None, None)
    return ref.paged_attention(batch.q.float(), k_cache, v_cache, batch.block_tables, batch.seq_lens_host,
                               batch.query_lens_host, HEAD_DIM ** -0.5, k_scale=k_scale, v_scale=v_scale)


def measure(batch: Batch, variants: tuple[Variant, ...], label: dict[str, Any], check: bool,
            iters: int) -> list[dict[str, Any]]:
    """One row per variant: relative error vs the reference (or None), us, GB/s, speedup over bf16. Each variant is
    timed twice, once in the list's order and once in reverse, and keeps the faster time (us_passes has both): a
    shape's first timing read 3-10% slow on the H200 (bench/results/s22), which would otherwise favour late variants."""
    expected = {fp8: reference(batch, fp8) for fp8 in (False, True)} if check else {}
    kv_tokens = sum(batch.seq_lens_host)
    num_kv_heads = batch.caches[False][0].shape[2]
    rows, runnable = [], []
    for variant in variants:
        config = variant_config(batch, variant)
        row: dict[str, Any] = {**label, "variant": variant.name, "config": asdict(config)}
        rows.append(row)
        try:
            out = run_variant(batch, variant, config)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses (registers, shared memory)
            row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        if check:
            want = expected[variant.fp8]
            row["rel_err"] = ((out.float() - want).abs().max() / want.abs().max()).item()
            row["ok"] = row["rel_err"] <= tolerance(variant)
        runnable.append((variant, config, row))
    for ordered in (runnable, runnable[::-1]):
        for variant, config, row in ordered:
            if "error" in row:
                continue
            try:
                row.setdefault("us_passes", []).append(graph_cycle_us(batch, variant, config, iters))
            except Exception as exc:  # noqa: BLE001 - a launch that cannot be captured: reported, the rest timed
                row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
    for variant, _, row in runnable:
        if "error" in row:
            continue
        us = min(row["us_passes"])
        kv_bytes = kv_tokens * num_kv_heads * HEAD_DIM * 2 * (1 if variant.fp8 else 2)
        row.update(us=us, kv_bytes=kv_bytes, tb_per_s=kv_bytes / us / 1e6)
    base = next((r["us"] for r in rows if r["variant"] == "bf16" and "us" in r), None)
    for row in rows:
        if base and "us" in row:
            row["speedup_vs_bf16"] = base / row["us"]
    return rows


def accuracy(model: str, num_heads: int, num_kv_heads: int, variants: tuple[Variant, ...], num_seqs: int = 64,
             context: tuple[int, int] = (512, 768)) -> list[dict[str, Any]]:
    """Max error / max |reference| of each fp8 decode variant at B=64, contexts 512-768, for a normal q and for one
    with OUTLIER_CHANNELS channels OUTLIER_GAIN x larger (every row's e4m3 scale then follows those channels)."""
    lo, hi = context
    seq_lens = [lo + (b * (hi - lo)) // num_seqs for b in range(num_seqs)]
    batch = make_batch(num_heads, num_kv_heads, [1] * num_seqs, seq_lens)
    outlier_q = batch.q.clone()  # [B, heads, D]
    outlier_q[..., :OUTLIER_CHANNELS] *= OUTLIER_GAIN
    rows = []
    for q_kind, q in (("normal q", batch.q), (f"q with {OUTLIER_CHANNELS} channels x{OUTLIER_GAIN:g}", outlier_q)):
        checked = replace(batch, q=q)
        want = reference(checked, True)
        for variant in (v for v in variants if v.fp8):
            out = run_variant(checked, variant, variant_config(checked, variant))
            rel_err = ((out.float() - want).abs().max() / want.abs().max()).item()
            row = {"model": model, "kind": "accuracy", "q": q_kind, "variant": variant.name, "rel_err": rel_err}
            if q is batch.q:  # judged on the timed rows' input; the large-channel q is measured, not judged (e4m3
                row["ok"] = rel_err <= tolerance(variant)  # q rows: 1.8e-1 seen on the CPU for qk_fp8, 4.7e-3 f16)
            rows.append(row)
    print(f"-- {model} accuracy, decode B={num_seqs} ctx {lo}-{hi}: max |error| / max |reference|")
    for variant in (v for v in variants if v.fp8):
        errs = [f"{r['q']} {r['rel_err']:.1e}{' FAIL' if r.get('ok') is False else ''}" for r in rows
                if r["variant"] == variant.name]
        print(f"   {variant.name:<18} " + ", ".join(errs))
    return rows


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"-- {title}")
    for row in rows:
        if "error" in row:
            print(f"   {row['variant']:<18} FAILED TO RUN {row['error']}")
            continue
        check = "-" if "rel_err" not in row else f"{row['rel_err']:.1e}{'' if row['ok'] else ' FAIL'}"
        print(f"   {row['variant']:<18} {row['us']:9.1f} us {row['tb_per_s']:6.2f} TB/s  x{row['speedup_vs_bf16']:.2f} "
              f"vs bf16  err {check}")


def print_summary(results: list[dict[str, Any]]) -> None:
    """One line per shape: bf16, the fp8 default and the fastest fp8 variant, as TB/s and time against bf16."""
    print("\n| model | kind | B | context | bf16 TB/s | fp8 default TB/s (x bf16 time) | best fp8 variant |")
    print("|---|---|---:|---|---:|---:|---|")
    results = [r for r in results if r["kind"] != "accuracy"]
    shapes = dict.fromkeys((r["model"], r["kind"], r["B"], r["ctx"]) for r in results)
    for model, kind, num_seqs, ctx in shapes:
        rows = {r["variant"]: r for r in results if (r["model"], r["kind"], r["B"], r["ctx"]) == (model, kind, num_seqs,
                                                                                                   ctx) and "us" in r}
        fp8 = [r for name, r in rows.items() if name.startswith("fp8") and name != "fp8_default"]
        if "bf16" not in rows or "fp8_default" not in rows or not fp8:
            continue
        best = min(fp8, key=lambda r: r["us"])
        default = rows["fp8_default"]
        print(f"| {model} | {kind} | {num_seqs} | {ctx} | {rows['bf16']['tb_per_s']:.2f} | {default['tb_per_s']:.2f} "
              f"(x{default['speedup_vs_bf16']:.2f}) | {best['variant']} {best['tb_per_s']:.2f} "
              f"(x{best['speedup_vs_bf16']:.2f}) |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=256 at context 512-768 only")
    parser.add_argument("--long", action="store_true", help="also B=1 and context 4096")
    parser.add_argument("--iters", type=int, default=10, help="graph replays per timing (each >= 512 MB of KV)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default="", help="comma-separated variant name prefixes (bf16 always runs)")
    parser.add_argument("--chunks-only", action="store_true", help="only the chunk shapes (no decode, no accuracy)")
    args = parser.parse_args(argv)
    prefixes = [p for p in args.only.split(",") if p]
    decode_variants, chunk_variants = select(DECODE_VARIANTS, prefixes), select(CHUNK_VARIANTS, prefixes)
    if not torch.cuda.is_available():
        print("kv_fp8_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    batches, contexts = ((256,), CONTEXTS[:1]) if args.quick else (BATCHES, CONTEXTS)
    if args.long:
        batches, contexts = LONG_BATCHES, LONG_CONTEXTS
    print(f"{torch.cuda.get_device_name(0)}, one layer, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; CUDA-graph times "
          f"over >= {CYCLE_BYTES >> 20} MB of KV a cycle (no L2 reuse)")
    results: list[dict[str, Any]] = []
    if args.chunks_only:
        batches = ()
    for model, (num_heads, num_kv_heads) in MODELS.items():
        if not args.chunks_only:
            results.extend(accuracy(model, num_heads, num_kv_heads, decode_variants))
        for num_seqs in batches:
            for lo, hi in contexts:
                seq_lens = [lo + (b * (hi - lo)) // num_seqs for b in range(num_seqs)]
                batch = make_batch(num_heads, num_kv_heads, [1] * num_seqs, seq_lens)
                label = {"model": model, "kind": "decode", "B": num_seqs, "ctx": f"{lo}-{hi}" if lo != hi else lo}
                rows = measure(batch, decode_variants, label, num_seqs * hi <= CHECK_MAX_TOKENS, args.iters)
                print_rows(f"{model} decode B={num_seqs} ctx {label['ctx']}", rows)
                results.extend(rows)
                del batch
        for ctx, query_lens, seq_lens in CHUNK_SHAPES:
            batch = make_batch(num_heads, num_kv_heads, query_lens, seq_lens)
            label = {"model": model, "kind": "chunk", "B": len(query_lens), "ctx": ctx}
            rows = measure(batch, chunk_variants, label, True, args.iters)
            print_rows(f"{model} chunks, {len(query_lens)} sequences: {ctx}", rows)
            results.extend(rows)
            del batch
        torch.cuda.empty_cache()
    print_summary(results)
    failed = [r for r in results if "error" in r or r.get("ok") is False]
    write_report({"device": torch.cuda.get_device_name(0), "rows": results}, args.out, "kv_fp8_bench.json", indent=1,
                 announce=True)
    failures = [(r["model"], r.get("B"), r.get("ctx", r.get("q")), r["variant"]) for r in failed]
    print(f"{len(results) - len(failed)} of {len(results)} variant rows ran and matched the reference "
          f"(where checked); failures: {failures}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
