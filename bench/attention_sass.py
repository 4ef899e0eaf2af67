"""What the decode attention kernel costs per key tile on an H100/H200, read from its sm_90 SASS on a machine with no
GPU: each fp8 conversion mode (and the bf16 cache for comparison) is compiled with Triton's real ptxas
(tests/gpu_compile.py's compile-only driver), then disassembled with the bundled nvdisasm. Prints registers a thread,
shared memory, programs an SM can hold (by registers and by shared memory), the SASS instructions of the unmasked
key-tile loop (per warp, per tile; the same per thread) and per KV byte a program reads, and the instruction kinds
that dominate the loop.

    TRITON_INTERPRET=0 python -m pagoda.bench.attention_sass [--heads 16] [--kv-heads 8] [--chunk] [--candidates]

--chunk: the tiled launch of query chunks (prefill against cached context) instead, per launch shape, with the
register count that decides whether two 8-warp programs share an SM (<= 128 a thread), and spills.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

MODES = {"bf16": 0, "native": 1, "f16": 2, "f16_bits": 3, "f16_words": 4, "f16_vwords": 5, "qk_fp8": 6, "qkv_fp8": 7,
         "f16_pinned": 8, "qk_fp8x2": 9}
VARIANTS = (("bf16", 64, 2, False), ("f16", 64, 2, False), ("f16", 128, 2, False), ("f16_words", 64, 2, False),
            ("f16_words", 128, 2, False), ("f16_words", 128, 3, False), ("f16_vwords", 128, 2, False),
            ("bf16", 64, 2, True), ("f16_words", 64, 2, True), ("f16_words", 128, 2, True),
            ("qk_fp8", 64, 2, False), ("qk_fp8", 128, 2, False), ("qk_fp8", 64, 2, True), ("qk_fp8", 128, 2, True),
            ("qkv_fp8", 64, 2, True), ("qkv_fp8", 128, 2, True), ("f16_pinned", 64, 2, False),
            ("f16_pinned", 64, 3, False), ("f16_pinned", 128, 2, False), ("f16_pinned", 64, 2, True),
            ("f16_pinned", 128, 2, True), ("qk_fp8x2", 64, 2, True), ("qk_fp8x2", 128, 2, True),
            ("qk_fp8x2", 64, 2, False))
# (cache / conversion, keys a tile, stages, keys on the dots' M rows); 4 warps
# --candidates: the default decode launches against one stage and a register cap, for more programs an SM
# (cache / conversion, stages, keys on M, sums per key slot, maxnreg); 64-key tiles, 4 warps
CANDIDATES = (("bf16", 2, False, False, 0), ("bf16", 2, False, False, 96), ("bf16", 1, False, False, 0),
              ("qk_fp8x2", 2, True, True, 0), ("qk_fp8x2", 1, True, True, 0), ("qk_fp8x2", 1, True, True, 96),
              ("qk_fp8x2", 1, True, True, 104), ("qk_fp8x2", 2, True, True, 96))
SM_BLOCK_RESERVED = 1024  # shared memory the SM keeps per resident block
HEAD_DIM, BLOCK_SIZE, NUM_WARPS = 128, 16, 4
SM_REGISTERS, SM_SHARED = 65536, 227 * 1024
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)")


def compile_decode(mode: str, tile_n: int, stages: int, keys_on_m: bool, num_heads: int,
                   num_kv_heads: int, num_warps: int = NUM_WARPS, lazy_sum: bool = False,
                   max_regs: int = 0, one_loop: bool = False):  # -> CompiledKernel
    from pagoda.kernels import paged_attention as pa

    num_seqs = 256
    q = torch.empty(num_seqs, num_heads, HEAD_DIM, dtype=torch.bfloat16)  # [B, heads, D]
    cache_dtype = torch.bfloat16 if mode == "bf16" else torch.float8_e4m3fn
    k_cache = torch.empty(64, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=cache_dtype)  # [blocks, bs, kvh, D]
    v_cache = torch.empty_like(k_cache)
    tables = torch.zeros(num_seqs, 64, dtype=torch.int32)  # [B, max_blocks]
    lens = torch.zeros(num_seqs, dtype=torch.int32)  # [B]
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)  # [B + 1]
    scale = torch.ones(1)  # [1]
    out = torch.empty_like(q)  # [B, heads, D]
    group = num_heads // num_kv_heads
    return pa._paged_attention_kernel.warmup(
        out, q, k_cache, v_cache, tables, lens, starts, out, out, out, scale, scale, 0.1, num_seqs, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=HEAD_DIM, HEAD_DIM_P=HEAD_DIM,
        BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=1, DOT_PRECISION="tf32", FP8_MODE=MODES[mode], HEADS_FAST=True,
        USE_ASM=True, KEYS_ON_M=keys_on_m, BLOCK_Q=1, BLOCK_M=max(16, triton.next_power_of_2(group)),
        TILE_N=tile_n, DECODE=True, SKIP_DECODE=False, Q_STAGED=False, USE_PDL=0, LAZY_SUM=lazy_sum,
        ONE_LOOP=one_loop, num_warps=num_warps, num_stages=stages, grid=(1,),
        **({"maxnreg": max_regs} if max_regs else {}))


@dataclass(frozen=True)
class ChunkVariant:
    """One launch shape of the tiled (chunk) launch; the first row with a bf16 cache is the baseline."""

    mode: str  # a MODES key
    block_m: int
    tile_n: int
    warps: int
    stages: int
    staged: bool  # Q_STAGED: q through the output rows, so the dots read it from shared memory
    max_regs: int  # maxnreg, 0 = the compiler's choice


CHUNK_VARIANTS = (
    ChunkVariant("bf16", 128, 32, 8, 1, False, 0),  # pick_config's bf16 chunk tiles
    ChunkVariant("f16_words", 128, 64, 8, 1, False, 0),  # the fp8 chunk default before Q_STAGED
    ChunkVariant("f16_words", 128, 32, 8, 1, False, 0),
    ChunkVariant("f16_words", 128, 32, 8, 1, True, 0),
    ChunkVariant("f16_words", 128, 32, 8, 1, True, 128),  # two programs an SM, as bf16
    ChunkVariant("f16_words", 128, 64, 8, 1, True, 128),
    ChunkVariant("f16_words", 128, 32, 8, 2, True, 128),
    ChunkVariant("f16", 128, 32, 8, 1, True, 128),
    ChunkVariant("qk_fp8", 128, 32, 8, 1, True, 128),
    ChunkVariant("bf16", 256, 32, 16, 1, False, 0),  # 256 rows: each converted tile serves twice the queries
    ChunkVariant("f16_words", 256, 32, 16, 1, True, 0),
    ChunkVariant("bf16", 64, 64, 4, 2, False, 0),  # pick_config's tiles for mostly-decode steps
    ChunkVariant("f16_words", 64, 64, 4, 2, False, 0),
    ChunkVariant("f16_words", 64, 64, 4, 2, True, 0),
    ChunkVariant("f16_words", 64, 32, 4, 2, True, 0),
    ChunkVariant("f16_words", 64, 64, 4, 2, True, 128),
    ChunkVariant("f16_pinned", 128, 32, 8, 1, True, 128),
    ChunkVariant("f16_pinned", 128, 64, 8, 1, False, 0),
    ChunkVariant("f16_pinned", 64, 64, 4, 2, False, 0),
)


def compile_chunk(variant: ChunkVariant, num_heads: int, num_kv_heads: int):  # -> CompiledKernel
    """The tiled launch (query chunks longer than one token) as paged_attention launches it."""
    from pagoda.kernels import paged_attention as pa

    num_seqs, num_tokens = 4, 2048
    q = torch.empty(num_tokens, num_heads, HEAD_DIM, dtype=torch.bfloat16)  # [T, heads, D]
    cache_dtype = torch.bfloat16 if variant.mode == "bf16" else torch.float8_e4m3fn
    k_cache = torch.empty(64, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=cache_dtype)  # [blocks, bs, kvh, D]
    v_cache = torch.empty_like(k_cache)
    tables = torch.zeros(num_seqs, 128, dtype=torch.int32)  # [B, max_blocks]
    lens = torch.zeros(num_seqs, dtype=torch.int32)  # [B]
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)  # [B + 1]
    scale = torch.ones(1)  # [1]
    out = torch.empty_like(q)  # [T, heads, D]
    group = num_heads // num_kv_heads
    regs = {"maxnreg": variant.max_regs} if variant.max_regs else {}
    return pa._paged_attention_kernel.warmup(
        out, q, k_cache, v_cache, tables, lens, starts, out, out, out, scale, scale, 0.1, num_seqs, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=HEAD_DIM, HEAD_DIM_P=HEAD_DIM,
        BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=1, DOT_PRECISION="tf32", FP8_MODE=MODES[variant.mode], HEADS_FAST=False,
        USE_ASM=True, KEYS_ON_M=False, BLOCK_Q=variant.block_m // group, BLOCK_M=variant.block_m,
        TILE_N=variant.tile_n, DECODE=False, SKIP_DECODE=True, Q_STAGED=variant.staged and variant.mode != "bf16",
        USE_PDL=0, num_warps=variant.warps, num_stages=variant.stages, grid=(1,), **regs)


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(SASS text, resource usage line) of a cubin, by the nvdisasm / cuobjdump bundled with Triton."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        sass = subprocess.run([tools / "nvdisasm", "-c", handle.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", handle.name], capture_output=True,
                               text=True, check=True).stdout
    finally:
        os.unlink(handle.name)
    return sass, usage


def loop_bodies(sass: str) -> list[list[str]]:
    """The instruction names of every loop (a branch back to an earlier label), in program order."""
    label_at: dict[str, int] = {}
    ops: list[tuple[str, str]] = []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            label_at[label.group(1)] = len(ops)
            continue
        match = SASS_LINE.match(line)
        if match:
            ops.append((match.group(2), match.group(3)))
    bodies = []
    for i, (op, rest) in enumerate(ops):
        target = re.search(r"(\.L_x_\d+)", rest) if op.startswith("BRA") else None
        if target and label_at.get(target.group(1), i + 1) <= i:
            bodies.append([name.split(".")[0] for name, _ in ops[label_at[target.group(1)]:i + 1]])
    return bodies


def chunk_table(num_heads: int, num_kv_heads: int) -> None:
    """The tiled launch's variants: registers, programs an SM, spills, and the unmasked loop per 64 keys x 128 rows
    (warp instructions, comparable across tile shapes)."""
    print(f"chunks, {num_heads} q / {num_kv_heads} kv heads, head_dim {HEAD_DIM}, sm_90")
    print("| cache / convert | rows | keys a tile | warps | stages | q staged | maxnreg | regs | shared KB | "
          "programs/SM | spill instrs (in the key loops) | loop warp instrs per 128 rows x 64 keys | "
          "top loop instructions |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for v in CHUNK_VARIANTS:
        kernel = compile_chunk(v, num_heads, num_kv_heads)
        sass, usage = disassemble(kernel.asm["cubin"])
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        shared = kernel.metadata.shared
        per_sm = min(SM_REGISTERS // (regs * 32 * v.warps), SM_SHARED // max(shared, 1))
        spills = sum(1 for line in sass.splitlines() if re.search(r"\b(STL|LDL)\b", line))
        loops = [b for b in loop_bodies(sass) if len(b) > 100]
        in_loops = sum(op in ("STL", "LDL") for body in loops for op in body)
        unmasked = min(loops, key=len)
        per_unit = len(unmasked) * v.warps * (128 / v.block_m) * (64 / v.tile_n)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(unmasked).most_common(5))
        print(f"| {v.mode} | {v.block_m} | {v.tile_n} | {v.warps} | {v.stages} | {'yes' if v.staged else 'no'} | "
              f"{v.max_regs or '-'} | {regs} | {shared / 1024:.0f} | {per_sm} | {spills} ({in_loops}) | "
              f"{per_unit:.0f} | {top} |")


def default_decode_loops(num_heads: int, num_kv_heads: int) -> list[dict[str, object]]:
    """The unmasked key-tile loop of pick_config's decode launches (64-key tiles, 4 warps, 2 stages): a bf16 cache,
    and an fp8 cache (qk_fp8x2, keys on M, sums per key slot): instructions a warp runs per tile, and spill
    instructions in it."""
    rows: list[dict[str, object]] = []
    for name, mode, tile_n, keys_on_m, warps, lazy in (("bf16", "bf16", 64, False, 4, False),
                                                       ("qk_fp8x2", "qk_fp8x2", 64, True, 4, True)):
        kernel = compile_decode(mode, tile_n, 2, keys_on_m, num_heads, num_kv_heads, warps, lazy)
        sass, _ = disassemble(kernel.asm["cubin"])
        unmasked = min((b for b in loop_bodies(sass) if any(op.endswith("MMA") for op in b)), key=len)
        rows.append({"mode": name, "loop": len(unmasked), "spills": sum(op in ("LDL", "STL") for op in unmasked)})
    return rows


def candidates_table(num_heads: int, num_kv_heads: int) -> None:
    """CANDIDATES: registers, shared memory, programs an SM (by both, the block reserve counted), the unmasked
    loop's length and its spill instructions."""
    print("| cache / convert | stages | sums per key slot | maxnreg | regs | shared KB | programs/SM | loop | "
          "loop spills | all spills |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, stages, keys_on_m, lazy, max_regs in CANDIDATES:
        kernel = compile_decode(mode, 64, stages, keys_on_m, num_heads, num_kv_heads, NUM_WARPS, lazy, max_regs)
        sass, usage = disassemble(kernel.asm["cubin"])
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        shared = kernel.metadata.shared
        per_sm = min(SM_REGISTERS // (regs * 32 * NUM_WARPS), SM_SHARED // (shared + SM_BLOCK_RESERVED))
        unmasked = min((b for b in loop_bodies(sass) if any(op.endswith("MMA") for op in b)), key=len)
        spills = sum(op in ("LDL", "STL") for op in unmasked)
        ops = [match.group(2).split(".")[0] for match in map(SASS_LINE.match, sass.splitlines()) if match]
        every = sum(op in ("LDL", "STL") for op in ops)
        print(f"| {mode} | {stages} | {'yes' if lazy else 'no'} | {max_regs or '-'} | {regs} | {shared / 1024:.1f} | "
              f"{per_sm} | {len(unmasked)} | {spills} | {every} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--chunk", action="store_true", help="the tiled launch for query chunks instead of decode")
    parser.add_argument("--candidates", action="store_true",
                        help="the default decode launches against one stage and a register cap (CANDIDATES)")
    parser.add_argument("--defaults-json", action="store_true",
                        help="only the default decode launches' loops, as JSON lines (tests/test_attention_sass.py)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import gpu_compile  # the compile-only sm_90 driver

    gpu_compile.driver.set_active(gpu_compile.CompileOnlyDriver())
    if args.defaults_json:
        for row in default_decode_loops(args.heads, args.kv_heads):
            print(json.dumps(row), flush=True)
        return 0
    if args.chunk:
        chunk_table(args.heads, args.kv_heads)
        return 0
    if args.candidates:
        candidates_table(args.heads, args.kv_heads)
        return 0
    print(f"decode, {args.heads} q / {args.kv_heads} kv heads, head_dim {HEAD_DIM}, {NUM_WARPS} warps, sm_90")
    print("| cache / convert | keys a tile | stages | keys on M | regs | shared KB | programs/SM | "
          "loop instrs a tile | per KV byte (x1000) | top loop instructions |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for mode, tile_n, stages, keys_on_m in VARIANTS:
        kernel = compile_decode(mode, tile_n, stages, keys_on_m, args.heads, args.kv_heads)
        sass, usage = disassemble(kernel.asm["cubin"])
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        shared = kernel.metadata.shared
        per_sm = min(SM_REGISTERS // (regs * 32 * NUM_WARPS), SM_SHARED // max(shared, 1))
        # the unmasked tile loop: the shortest long loop (the masked loop adds the causal and key masks)
        unmasked = min((b for b in loop_bodies(sass) if len(b) > 100), key=len)
        tile_bytes = 2 * tile_n * HEAD_DIM * (2 if mode == "bf16" else 1)  # K and V
        warp_instrs = len(unmasked) * NUM_WARPS
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(unmasked).most_common(6))
        print(f"| {mode} | {tile_n} | {stages} | {'yes' if keys_on_m else 'no'} | {regs} | {shared / 1024:.0f} | "
              f"{per_sm} | {len(unmasked)} | "
              f"{1000 * warp_instrs / tile_bytes:.0f} | {top} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
