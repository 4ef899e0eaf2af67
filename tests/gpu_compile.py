"""Compile, for an H100/H200 (sm_90), every Triton kernel the model families launch, on a machine with no GPU.

The CPU suite runs kernels in Triton's interpreter, which accepts code the GPU compiler rejects (an arange over a
length that is not a power of two, a plain global read inside a kernel, a dtype mix in tl.dot ...): such a bug
first shows on the GPU machine, where time is short. This script replaces Triton's driver by one that reports an
sm_90 target, turns every kernel launch into a compile-only warm-up (Triton's own `warmup=True` path: frontend,
TTGIR, LLVM and ptxas, all bundled with the triton wheel), then runs small models through the Triton ops so each
kernel is compiled with the constexprs and argument specialisations a real run gives them; then the MLA kernel at
DeepSeek's real dims (its large tiles are where shared memory and registers run out), the fused MoE layer's
default GEMV tiles at real row lengths; then the sampler's
start-up warm-up, which launches every sampling-kernel variant a served batch can. Outputs are never
computed (launches do nothing), so the models' numbers are garbage and only the compiles matter.

    TRITON_INTERPRET=0 python tests/gpu_compile.py [--to-ptx] [1 | 2 | 3]  # one part (PARTS); --to-ptx: no
                                    # ptxas; tests/test_gpu_compile.py runs 1 and 2 in two subprocesses side by side

Prints one line per kernel (ok / FAIL with the compiler's message) and any step the runner could not run (a
wrapper's check refusing a launch shape), and exits 1 on either.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from typing import Any

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling for the GPU needs TRITON_INTERPRET unset or 0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # an sm_90 block's dynamic shared memory at most (H100 and H200)
RESULTS: dict[str, str] = {}
STEP_ERRORS: list[str] = []  # a step the runner could not run (logged and swallowed by the worker's loop)


class StepErrors(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        STEP_ERRORS.append(record.getMessage()[-600:])


class CompileOnlyDriver:
    """Just enough of Triton's CUDA driver for JITFunction.run(warmup=True) to compile for TARGET."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        return torch.cuda

    def is_active(self) -> bool:
        return True


def stop_at_ptx() -> None:
    """Leave out the last stage, ptxas (PTX -> SASS, ~20% of the compile time): every Triton pass and LLVM's
    instruction selection for sm_90 still run. The compiles go to a Triton cache of their own (the cache key does
    not see this hook), since a GPU launch or a SASS dump that found an entry with no cubin in it would fail."""
    from triton import knobs

    knobs.cache.dir = f"{knobs.cache.dir.rstrip(os.sep)}-to-ptx"

    def without_ptxas(backend: Any, stages: dict[str, Any], options: Any, language: Any, capability: Any) -> None:
        stages["cubin"] = lambda ptx, metadata: b""

    knobs.runtime.add_stages_inspection_hook = without_ptxas


def install() -> None:
    driver.set_active(CompileOnlyDriver())
    launch = JITFunction.run

    def compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # the compiler's error is the result this script reports
            RESULTS[self.__name__] = f"FAIL {type(exc).__name__}: {exc}"
            return
        shared = getattr(getattr(kernel, "metadata", None), "shared", 0)
        if shared > MAX_SHARED_BYTES:  # a launch would refuse it (Triton checks only when it loads the binary)
            RESULTS[self.__name__] = f"FAIL out of shared memory: {shared} B > {MAX_SHARED_BYTES} B"
        else:
            RESULTS.setdefault(self.__name__, "ok")

    JITFunction.run = compile_only  # type: ignore[method-assign]


def run_models() -> None:
    """Each tiny shape, dtype and quantization through the Triton ops: decode rows (W8A16 at few rows), a long
    prefill chunk (W8A8, the MoE GEMM path), prefix reuse (chunks over cached context)."""
    from pagoda.bench.fp8_bench import greedy_steps
    from pagoda.services.scheduler.scheduler import Scheduler
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.services.worker.models import triton_ops
    from pagoda.shared.config import EngineConfig

    shared = list(range(2, 34))
    prompts = [[3] * 3, [4] * 20, [5] * 100, shared + [7, 8, 9], shared + [10, 11]]
    variants = ({}, {"quantization": "fp8"}, {"quantization": "fp8", "kv_cache_dtype": "fp8"},
                {"quantization": "fp8_block", "kv_cache_dtype": "fp8"})
    runs = [(shape, "bfloat16", variant) for shape, variant in itertools.product(
        ("tiny", "tiny-qwen3", "tiny-moe", "tiny-deepseek-v3"), variants)]
    runs += [("tiny", "float32", variant) for variant in variants]  # fp32 activations: the ieee-dot variants
    # the sparse layers' top-k sums left to the next norm (bf16 parts in the norm kernel) are the default
    # (base.moe_experts), so the bf16 MoE runs above compile them; two more runs with PAGODA_FUSE_MOE_SUM=1 compiled
    # nothing new
    for shape, dtype, settings in runs:
        config = EngineConfig(model=shape, load_format="dummy", device="cpu", dtype=dtype, num_kv_blocks=48,
                              max_model_len=256, max_num_seqs=8, enforce_eager=True, seed=1, **settings)
        runner = ModelRunner(config, ops=triton_ops())
        scheduler = Scheduler(num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                              max_model_len=256, vocab_size=runner.arch.vocab_size)
        try:
            greedy_steps(runner, scheduler, prompts, 3)
        except Exception as exc:  # garbage numbers may trip a later check; the compiles are what counts
            print(f"{shape} {dtype} {settings}: run stopped ({type(exc).__name__}: {str(exc)[:120]})")


def run_mla_shapes() -> None:
    """The MLA kernel at DeepSeek's real dims (latent 512 + rope 64; 16 heads as V2-Lite, 128 as V3), bf16 and fp8
    caches, decode batches (small and large: split-KV or not) and a chunk, with the default launch shapes: the
    tiny models' dims leave the shared-memory and register limits of the real tiles untested."""
    from pagoda.kernels.mla import mla_attention

    for num_heads, cache_dtype, (num_seqs, query_len) in itertools.product(
            (16, 128), (torch.bfloat16, torch.float8_e4m3fn), ((256, 1), (4, 1), (2, 64))):
        context = 1024
        q = torch.empty(num_seqs * query_len, num_heads, 576, dtype=torch.bfloat16)  # [T, heads, R + P]
        cache = torch.empty(num_seqs * context // 16, 16, 576, dtype=cache_dtype)  # [N, bs, R + P]
        block_tables = torch.zeros(num_seqs, context // 16, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * query_len
        kv_scale = torch.ones(1) if cache_dtype == torch.float8_e4m3fn else None
        mla_attention(q, cache, block_tables, seq_lens, qsl, query_len, context, 0.1, 512, kv_scale=kv_scale)


def run_moe_shapes() -> None:
    """The fused MoE layer's default GEMV tiles at real dims (1 token; tiles as pick_tiles gives them to an untuned
    shape), and the down GEMV with every pair at once: DeepSeek-V2-Lite with its 2 shared experts fused (66 experts,
    8 a token; K = 2048 and 1408), Mixtral-sized rows (K = 4096 and 14336), V3's in FP8 blocks of 128. Few experts
    are allocated: the launch shapes do not depend on their count."""
    from pagoda.kernels import moe

    for (experts, top_k, inter, hidden), fp8 in (((66, 8, 1408, 2048), False), ((8, 2, 14336, 4096), False),
                                                 ((257, 9, 2048, 7168), True)):
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        w_gate_up = torch.empty(2, 2 * inter, hidden, dtype=dtype)  # [2, 2I, H]
        w_down = torch.empty(2, hidden, inter, dtype=dtype)  # [2, H, I]
        scales = ((torch.empty(2, 2 * inter, hidden // 128), torch.empty(2, hidden, inter // 128)) if fp8
                  else (None, None))
        ids = torch.zeros(1, top_k, dtype=torch.int32)  # [1, k]
        weights = torch.ones(1, top_k)  # [1, k]
        tiles = moe.default_tiles(1, top_k, experts, inter, hidden)
        logits = torch.empty(1, experts - 1 if fp8 else experts - 2)  # [1, E]: routed experts (CPU: never on CUDA)
        moe.router_logits_triton(torch.empty(1, hidden, dtype=torch.bfloat16), torch.empty(logits.shape[1], hidden))
        if fp8:  # DeepSeek-V3 routing, its shared expert appended; Mixtral's softmax top-k
            moe.route_grouped_topk_triton(logits, 8, "sigmoid", "noaux_tc", 8, 4, torch.empty(256), True, 2.5, 1)
        elif experts == 66:  # V2-Lite routing, its 2 shared experts appended
            moe.route_grouped_topk_triton(logits, 6, "softmax", "greedy", 1, 1, None, False, 1.0, 2)
        else:  # and Qwen2-MoE's: 60 experts + the gate of a shared expert fused as 4
            moe.route_softmax_topk_triton(logits, top_k, True)
            moe.route_softmax_topk_triton(torch.empty(1, 61), 4, False, 4)
        moe.fused_experts(torch.empty(1, hidden, dtype=torch.bfloat16), w_gate_up, w_down, weights, ids, *scales,
                          group_k=128 if fp8 else None, tiles=tiles)
        at_once = moe.GemvConfig(8, 128, 4, 3, pairs_at_once=True)  # a tuner candidate for the down GEMV
        moe.fused_experts(torch.empty(1, hidden, dtype=torch.bfloat16), w_gate_up, w_down, weights, ids, *scales,
                          group_k=128 if fp8 else None, tiles=(tiles[0], at_once))
        moe.align_pairs_triton(torch.zeros(256, top_k, dtype=torch.int32), experts, 64)  # decode batches' layout
        moe.align_pairs_by_expert(torch.zeros(256, top_k, dtype=torch.int32), experts, 64)  # ... from 32 experts
        moe.align_pairs_by_expert(torch.zeros(8, top_k, dtype=torch.int32), experts, 16)
        moe.align_pairs_spread(torch.zeros(2048, top_k, dtype=torch.int32), experts, 128)  # prefill's


def run_moe_act_fp8() -> None:
    """FP8 experts' W8A8 grouped GEMMs (act_fp8) at a large batch, with the tiles an untuned shape gets there:
    DeepSeek-V2-Lite's experts with per-row scales, V3's in blocks of 128."""
    from pagoda.kernels import moe

    os.environ["PAGODA_MOE_ACT_FP8"] = "1"
    try:
        for (experts, top_k, inter, hidden), group_k in (((66, 8, 1408, 2048), None), ((257, 9, 2048, 7168), 128)):
            w_gate_up = torch.empty(2, 2 * inter, hidden, dtype=torch.float8_e4m3fn)  # [2, 2I, H]
            w_down = torch.empty(2, hidden, inter, dtype=torch.float8_e4m3fn)  # [2, H, I]
            groups_up, groups_down = (1, 1) if group_k is None else (hidden // group_k, inter // group_k)
            scales = (torch.empty(2, 2 * inter, groups_up), torch.empty(2, hidden, groups_down))
            tokens = 1024
            ids = torch.zeros(tokens, top_k, dtype=torch.int32)  # [T, k]
            weights = torch.ones(tokens, top_k)  # [T, k]
            tiles = moe.default_tiles(tokens, top_k, experts, inter, hidden)
            moe.fused_experts(torch.empty(tokens, hidden, dtype=torch.bfloat16), w_gate_up, w_down, weights, ids,
                              *scales, group_k=group_k, tiles=tiles)
    finally:
        os.environ.pop("PAGODA_MOE_ACT_FP8")


# fp8_convert / key tile / keys on the dots' M rows: the default decode launch's (pick_config: "qk_fp8x2", 64-key
# tiles, keys on M), then the measured candidates no served launch takes (bench/kv_fp8_bench.py, attention_sass):
# "qk_fp8" (e4m3 q x e4m3 K on the tensor cores), "qkv_fp8" (also e4m3 p x e4m3 V, falling back to "qk_fp8" on
# 16-key tiles, below the fp8 MMA's K), "f16_pinned", and "qk_fp8x2" with keys off M.
FP8_QK_DEFAULT = (("qk_fp8x2", 64, True),)
FP8_QK_CANDIDATES = (("qk_fp8", 64, True), ("qk_fp8", 128, True), ("qk_fp8", 64, False), ("qkv_fp8", 64, True),
                     ("qkv_fp8", 16, False), ("f16_pinned", 64, False), ("f16_pinned", 128, False),
                     ("f16_pinned", 64, True), ("qk_fp8x2", 64, False))


def run_fp8_qk_attention_shapes() -> None:
    """The default fp8-cache decode launch mode forced on every launch shape below (FP8_QK_DEFAULT)."""
    _fp8_qk_attention_shapes(FP8_QK_DEFAULT)


def run_fp8_qk_attention_candidates() -> None:
    """The measured candidates' modes on the same launch shapes (FP8_QK_CANDIDATES; ~2 minutes of compiles)."""
    _fp8_qk_attention_shapes(FP8_QK_CANDIDATES)


def _fp8_qk_attention_shapes(modes: tuple[tuple[str, int, bool], ...]) -> None:
    """Paged attention over an fp8 cache in each (fp8_convert, key tile, keys on M) of `modes` at qwen3-0.6b's
    (16 q / 8 kv heads) and llama3-8b's (32 / 8) real dims, head_dim 128: decode batches large (one program per
    sequence and kv head) and small (split-KV); and chunks over cached context beside decode rows (the tiled
    launch)."""
    from dataclasses import replace

    from pagoda.kernels.paged_attention import AttentionConfig, paged_attention, pick_config

    for num_heads, (num_seqs, query_len), (convert, tile_n, keys_on_m) in itertools.product(
            (16, 32), ((256, 1), (4, 1), (3, 64)), modes):
        context, num_kv_heads = 1024, 8
        query_lens = [query_len] * num_seqs + ([1, 1] if query_len > 1 else [])  # chunks beside decode rows
        q = torch.empty(sum(query_lens), num_heads, 128, dtype=torch.bfloat16)  # [T, heads, D]
        cache = torch.empty(len(query_lens) * context // 16, 16, num_kv_heads, 128,
                            dtype=torch.float8_e4m3fn)  # [N, bs, kvh, D]
        block_tables = torch.zeros(len(query_lens), context // 16, dtype=torch.int32)
        seq_lens = torch.full((len(query_lens),), context, dtype=torch.int32)
        qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
        base = pick_config(q.shape[0], len(query_lens), num_kv_heads, num_heads // num_kv_heads, query_len, context,
                           fp8_kv=True)
        config: AttentionConfig = replace(base, fp8_convert=convert, decode_tile_n=tile_n,
                                          decode_keys_on_m=keys_on_m, decode_fp8_convert="")
        paged_attention(q, cache, cache, block_tables, seq_lens, qsl, query_len, context, 0.1, config=config,
                        k_scale=torch.ones(1), v_scale=torch.ones(1))


def run_decode_occupancy_candidates() -> None:
    """The decode launches prepared for more programs an SM (kv_fp8_bench's fp8_s22_s1, fp8_s22_s1_r96,
    bf16_s22_r96): one stage and a 96-register cap, at qwen3-0.6b's heads, fp8 and bf16 caches."""
    from dataclasses import replace

    from pagoda.kernels.paged_attention import paged_attention, pick_config

    num_seqs, context, num_heads, num_kv_heads = 256, 1024, 16, 8
    for cache_dtype, changes in ((torch.float8_e4m3fn, {"decode_num_stages": 1}),
                                 (torch.float8_e4m3fn, {"decode_num_stages": 1, "decode_max_regs": 96}),
                                 (torch.bfloat16, {"decode_max_regs": 96})):
        fp8 = cache_dtype == torch.float8_e4m3fn
        q = torch.empty(num_seqs, num_heads, 128, dtype=torch.bfloat16)  # [T, heads, D]
        cache = torch.empty(num_seqs * context // 16, 16, num_kv_heads, 128, dtype=cache_dtype)  # [N, bs, kvh, D]
        block_tables = torch.zeros(num_seqs, context // 16, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
        config = replace(pick_config(num_seqs, num_seqs, num_kv_heads, 2, 1, context, fp8_kv=fp8), **changes)
        scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if fp8 else {}
        paged_attention(q, cache, cache, block_tables, seq_lens, qsl, 1, context, 0.1, config=config, **scales)


def run_fp8_default_decode_shapes() -> None:
    """pick_config's own decode launch over an fp8 cache (qk_fp8x2, keys on the dots' M rows) at the head dims and
    GQA groups of common models beyond the two above: SmolLM2 (64, 9 q / 3 kv heads), 96-dim heads, multi-head
    attention (group 1), a group of 8 (70B-class), 256-dim heads (Gemma-class)."""
    from pagoda.kernels.paged_attention import paged_attention

    for head_dim, num_heads, num_kv_heads in ((64, 9, 3), (96, 32, 8), (128, 16, 16), (128, 64, 8), (256, 8, 4)):
        paged_attention(*_fp8_decode_batch(head_dim, num_heads, num_kv_heads), k_scale=torch.ones(1),
                        v_scale=torch.ones(1))


def _fp8_decode_batch(head_dim: int, num_heads: int, num_kv_heads: int) -> tuple[Any, ...]:
    """paged_attention's leading arguments for 8 decode rows over 256 cached tokens of an fp8 cache."""
    num_seqs, context = 8, 256
    q = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.bfloat16)  # [T, heads, D]
    cache = torch.empty(num_seqs * context // 16, 16, num_kv_heads, head_dim,
                        dtype=torch.float8_e4m3fn)  # [N, bs, kvh, D]
    block_tables = torch.zeros(num_seqs, context // 16, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
    return q, cache, cache, block_tables, seq_lens, qsl, 1, context, 0.1


def run_fp8_gluon_decode_shapes() -> None:
    """The hand-pipelined Gluon decode kernel (AttentionConfig.decode_pipelined) through paged_attention, as if on
    an sm_90 GPU: ring depths 2-4, splits, groups of 1 to 16 heads (packed score dots up to 8), head dims 64 to 256."""
    from dataclasses import replace

    from pagoda.kernels import fp8_decode_gluon
    from pagoda.kernels.paged_attention import AttentionConfig, paged_attention

    fp8_decode_gluon.on_hopper = lambda q: True  # the compile-only driver's target
    base = AttentionConfig(fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True, decode_pipelined=True)
    for head_dim, num_heads, num_kv_heads, splits, stages, tile_n in (
            (128, 16, 8, 1, 2, 64), (128, 32, 8, 1, 3, 64), (128, 32, 8, 64, 2, 64), (64, 9, 3, 1, 2, 64),
            (128, 64, 4, 1, 2, 64), (256, 8, 4, 4, 2, 64), (64, 8, 8, 1, 4, 64)):
        config = replace(base, num_splits=splits, decode_num_stages=stages, decode_tile_n=tile_n)
        paged_attention(*_fp8_decode_batch(head_dim, num_heads, num_kv_heads), config=config, k_scale=torch.ones(1),
                        v_scale=torch.ones(1))


def run_fp8_chunk_attention_shapes() -> None:
    """Chunks over an fp8 cache with pick_config's own launch shapes (q staged through the output rows, the
    128-register cap on 128-row tiles) at qwen3-0.6b's and llama3-8b's dims, head_dim 128: 4 x 512 new queries over
    1024 cached tokens, and the same beside 124 decode rows (the mostly-decode 64-row tiles; the decode rows in
    the decode-only launch's qk_fp8x2 with sums per key slot); and the dequantization
    of an fp8 cache's blocks into a bf16 scratch (kv_fp8_bench's fp8_dequant variant)."""
    from pagoda.kernels.kv_cache import dequantize_blocks
    from pagoda.kernels.paged_attention import paged_attention

    for num_heads, num_decodes in itertools.product((16, 32), (0, 124)):
        context, num_kv_heads = 1536, 8
        query_lens = [512] * 4 + [1] * num_decodes
        q = torch.empty(sum(query_lens), num_heads, 128, dtype=torch.bfloat16)  # [T, heads, D]
        cache = torch.empty(len(query_lens) * context // 16, 16, num_kv_heads, 128,
                            dtype=torch.float8_e4m3fn)  # [N, bs, kvh, D]
        block_tables = torch.zeros(len(query_lens), context // 16, dtype=torch.int32)  # [B, max_blocks]
        seq_lens = torch.full((len(query_lens),), context, dtype=torch.int32)  # [B]
        qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)  # [B + 1]
        paged_attention(q, cache, cache, block_tables, seq_lens, qsl, 512, context, 0.1,
                        k_scale=torch.ones(1), v_scale=torch.ones(1))
    cache = torch.empty(64, 16, 8, 128, dtype=torch.float8_e4m3fn)  # [N, bs, kvh, D]
    dequantize_blocks(cache, cache, torch.ones(1), torch.ones(1), torch.arange(8), torch.bfloat16)


def run_sampler() -> None:
    """The sampler's start-up warm-up (every variant a served batch can launch) through the Triton kernels."""
    from pagoda.services.worker.sampler import sample
    from pagoda.services.worker.sampler_warmup import warm_up_sampler

    warm_up_sampler(lambda logits, metadata: sample(logits, metadata, use_kernels=True), 4096, torch.bfloat16,
                    torch.device("cpu"), [0])


def run_block_copy() -> None:
    """Beam search's block copy (kernels/block_copy.py) on 16-token blocks of llama3-8b's K/V rows, bf16 and fp8."""
    from pagoda.kernels.block_copy import copy_blocks

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.empty(4, 8, 16, 8, 128, dtype=dtype)  # [planes, N, bs, kv heads, D]
        copy_blocks(cache, torch.tensor([0, 1]), torch.tensor([2, 1]))


def run_dense_gemv() -> None:
    """The GEMV for 16-bit weights (kernels/gemv.py, PAGODA_DENSE_GEMV=1) at llama3-8b's and DeepSeek-V2-Lite's
    projection shapes, one token (FMA tiles) and eight (tensor-core tiles), bf16 and fp16; at decode batches (64,
    256 rows: what a tuned entry may serve) the tuner's swap_ab and 64-row tiles with split-K, bf16; the per-head
    GEMV of MLA's absorbed projections at DeepSeek's dims."""
    from pagoda.kernels.fp8_weight_only import GemvTiles
    from pagoda.kernels.gemv import dense_gemv

    for (n, k), rows, dtype in itertools.product(((6144, 4096), (4096, 14336), (3648, 2048)), (1, 8),
                                                 (torch.bfloat16, torch.float16)):
        dense_gemv(torch.empty(rows, k, dtype=dtype), torch.empty(n, k, dtype=dtype))
    for (n, k), rows, swap in itertools.product(((3648, 2048), (2048, 2048)), (64, 256), (False, True)):
        tiles = GemvTiles(block_m=64, block_n=128, block_k=128, split_k=2, use_dot=True, num_warps=8, num_stages=3,
                          swap_ab=swap)
        dense_gemv(torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16), tiles=tiles)
    from pagoda.kernels.gemv import head_gemv

    for heads, rows in itertools.product((16, 128), (1, 8)):  # DeepSeek-V2-Lite's and V3's absorbed projections
        kv_b = torch.empty(heads, 256, 512, dtype=torch.bfloat16)  # [heads, Dn + Dv, R]
        head_gemv(torch.empty(rows, heads, 192, dtype=torch.bfloat16)[..., :128].transpose(0, 1), kv_b[:, :128])
        head_gemv(torch.empty(heads, rows, 512, dtype=torch.bfloat16), kv_b[:, 128:].transpose(1, 2))


def run_w8a16_swap_ab() -> None:
    """The W8A16 kernel's swap_ab tensor-core tiles (bench/fp8_tune.py's candidates from 8 rows) at llama3-8b's o
    and down shapes, per-channel and 128-wide group scales; the gated down projection with default tiles; the
    consumers of a deferred layer's partials: the norm quantizing for a W8A8 GEMM, qkv prep."""
    from pagoda.kernels import fp8_weight_only as w8

    for (n, k), (rows, block_n, warps), group in itertools.product(
            ((4096, 4096), (4096, 14336)), ((16, 256, 8), (64, 128, 4)), (None, 128)):
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale = torch.empty(n, 1 if group is None else k // group, dtype=torch.float32)
        tiles = w8.GemvTiles(block_m=rows, block_n=block_n, block_k=128, split_k=4, use_dot=True, num_warps=warps,
                             num_stages=3, swap_ab=True)
        w8.fp8_weight_only_linear(torch.empty(rows, k, dtype=torch.bfloat16), weight, scale, group, tiles=tiles)
    # the gated down projection (PAGODA_FUSE_SILU_GEMV=1): [gate ‖ up] rows in, at one token and at 16
    weight, scale = torch.empty(4096, 14336, dtype=torch.float8_e4m3fn), torch.empty(4096, 1, dtype=torch.float32)
    for rows in (1, 16):
        w8.fp8_weight_only_deferred(torch.empty(rows, 2 * 14336, dtype=torch.bfloat16), weight, scale, None,
                                    gated=True)
    swap = w8.GemvTiles(block_m=64, block_n=128, block_k=128, split_k=4, use_dot=True, num_warps=8, num_stages=3,
                        swap_ab=True)  # the committed table's down tile at 64 rows
    w8.fp8_weight_only_deferred(torch.empty(64, 2 * 14336, dtype=torch.bfloat16), weight, scale, None, tiles=swap,
                                gated=True)
    # the norm after such a layer where the next GEMM is W8A8 (the table's 32-64-row buckets): it sums the four
    # fp32 partials and quantizes for that GEMM
    from pagoda.kernels.fp8 import add_rms_norm_parts_quant_fp8

    hidden = torch.empty(64, 4096, dtype=torch.bfloat16)  # [T, H]
    add_rms_norm_parts_quant_fp8(torch.empty(4, 64, 4096), torch.bfloat16, hidden, hidden[0], 1e-5)
    # qkv prep taking the qkv GEMV's partials (2-32 rows: the table's split-K qkv tiles), bf16 and fp8 caches
    from pagoda.kernels.qkv_prep import prepare_qkv

    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.empty(8, 16, 8, 128, dtype=cache_dtype)  # [N, bs, kv heads, D]
        rope = torch.empty(64, 128, dtype=torch.bfloat16)  # [positions, D]
        prepare_qkv(w8.DeferredSum(torch.empty(4, 16, 6144), torch.bfloat16), 32, 8, 128, None, None, 1e-5, rope,
                    rope, torch.zeros(16, dtype=torch.int64), cache, cache, torch.zeros(16, dtype=torch.int64),
                    torch.ones(1), torch.ones(1))


def run_w8a16_act_fp8() -> None:
    """The act_fp8 tiles (the activation tile quantized in registers, e4m3 x e4m3 on the tensor cores; bench/
    fp8_tune.py's candidates from 2 rows), swap_ab or not, per-channel and 128-wide group scales, bf16 and fp32
    activations, and gated."""
    from pagoda.kernels import fp8_weight_only as w8

    shapes = ((64, 64, 128, 8, True), (128, 128, 64, 8, False), (32, 32, 64, 4, False), (4, 16, 256, 8, True))
    launches = [(shape, group, torch.bfloat16) for shape, group in itertools.product(shapes, (None, 128))]
    launches += [(shape, None, torch.float32) for shape in shapes[::3]]  # fp32 activations: the ieee-dot variant
    for (rows, block_m, block_n, warps, swap), group, dtype in launches:
        n, k = 4096, 4096
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale = torch.empty(n, 1 if group is None else k // group, dtype=torch.float32)
        tiles = w8.GemvTiles(block_m=block_m, block_n=block_n, block_k=128, split_k=2, use_dot=True,
                             num_warps=warps, num_stages=3, swap_ab=swap, act_fp8=True)
        w8.fp8_weight_only_linear(torch.empty(rows, k, dtype=dtype), weight, scale, group, tiles=tiles)
    weight, scale = torch.empty(4096, 14336, dtype=torch.float8_e4m3fn), torch.empty(4096, 1, dtype=torch.float32)
    tiles = w8.GemvTiles(block_m=64, block_n=128, block_k=128, split_k=4, use_dot=True, num_warps=8, num_stages=3,
                         swap_ab=True, act_fp8=True)
    w8.fp8_weight_only_deferred(torch.empty(64, 2 * 14336, dtype=torch.bfloat16), weight, scale, None, tiles=tiles,
                                gated=True)


# The two halves test_gpu_compile.py runs side by side in the default run (one process each; on the 2-core CPU,
# cold: ~105 s and ~120 s of compiles, alone), and part 3, the measured candidates no served launch takes (~130 s; the
# `extended` test, make test-all). Each keeps the order the whole ran in: from run_fp8_gluon_decode_shapes on,
# fp8-cache decode launches take the Gluon kernel (on_hopper is patched), and what follows it relies on that.
PARTS = {
    "1": ("run_models", "run_sampler", "run_block_copy", "run_dense_gemv", "run_w8a16_swap_ab", "run_w8a16_act_fp8"),
    "2": ("run_mla_shapes", "run_moe_shapes", "run_moe_act_fp8", "run_fp8_qk_attention_shapes",
          "run_fp8_default_decode_shapes",
          "run_fp8_gluon_decode_shapes", "run_decode_occupancy_candidates", "run_fp8_chunk_attention_shapes"),
    "3": ("run_fp8_qk_attention_candidates",),
}


def main(argv: list[str]) -> int:
    """argv: a PARTS key to compile that part only (none: all of them, one after the other); --to-ptx: without
    ptxas (stop_at_ptx)."""
    to_ptx = "--to-ptx" in argv
    parts = [arg for arg in argv if arg != "--to-ptx"] or sorted(PARTS)
    if not set(parts) <= PARTS.keys():
        print(f"usage: gpu_compile.py [--to-ptx] [{' | '.join(PARTS)}]")
        return 2
    if to_ptx:
        stop_at_ptx()
    install()
    logging.getLogger("pagoda").addHandler(StepErrors(level=logging.ERROR))
    for part in parts:
        for step in PARTS[part]:
            globals()[step]()
    for name, result in sorted(RESULTS.items()):
        print(f"{name}: {result}")
    for message in STEP_ERRORS:
        print(f"step error: {message}")
    failed = [name for name, result in RESULTS.items() if result != "ok"]
    print(f"{len(RESULTS)} kernels compiled for sm_90, {len(failed)} failed, {len(STEP_ERRORS)} step errors")
    return 1 if failed or STEP_ERRORS or not RESULTS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
