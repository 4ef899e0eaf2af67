"""Weights pulled into L2 on a side stream while a small-batch decode step runs latency-bound kernels.

At batch 1 a decode layer alternates weight reads (GEMVs that keep HBM busy) with short kernels that barely touch
it (qkv prep, paged or latent attention, its split reduce, the norms, the router): ~10-20 us a layer in which
HBM idles. A GEMV also loses a few microseconds to ramp and tail on a 10-25 MB matrix. So, inside a `scope`, a
layer may ask for the weights of its next GEMVs to be prefetched: a kernel on a side stream (forked from the
step's stream at that point, so it starts once everything before it has run) issues L2 prefetches over their
bytes, and the GEMV then reads them from L2. Nothing is written, so results are bit-identical; the scope joins the
side stream back into the step's stream when it closes (a CUDA graph captures the fork and the join).

Two ways to issue them on sm90 (which one pays was measured, bench/RESULTS.md): MODE_LINES, one
`prefetch.global.L2` per 128-byte line from every thread; MODE_BULK, one `cp.async.bulk.prefetch.L2` per
BULK_BYTES chunk (the TMA unit walks it). MODE_RECORD marks the lines a launch would prefetch in a byte map
instead: the interpreter cannot run the inline PTX, so the CPU tests check the addressing that way.

PAGODA_L2_PREFETCH=lines or =bulk turns it on and picks the way; PAGODA_L2_PREFETCH_MB caps the bytes a layer
asks for past its first tensor.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # an L2 line (the prefetch granule)
BULK_BYTES = 16384  # bytes one cp.async.bulk.prefetch covers (a multiple of 16)
MODE_RECORD, MODE_LINES, MODE_BULK = 0, 1, 2
_BLOCK = 512  # lines (or bulk chunks) a program issues per loop iteration
_DEFAULT_PROGRAMS = 16


@triton.jit
def _l2_prefetch_kernel(base_ptr, num_units, units_per_program, marks_ptr, UNIT: tl.constexpr,
                        BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Program p covers units [p * per, (p + 1) * per) of num_units (a unit: one line, or one bulk chunk of UNIT
    bytes) of the bytes at base_ptr: prefetches them (MODE_LINES / MODE_BULK) or sets marks[unit] = 1."""
    pid = tl.program_id(0)
    first = pid * units_per_program
    end = tl.minimum(first + units_per_program, num_units)
    for start in range(first, end, BLOCK):
        unit = start + tl.arange(0, BLOCK)  # [BLOCK]
        if MODE == 0:
            tl.store(marks_ptr + unit, tl.full([BLOCK], 1, tl.uint8), mask=unit < end)
        else:
            # inline PTX has no mask: units past the end repeat the last one (a duplicate prefetch is harmless)
            addr = base_ptr + tl.minimum(unit, end - 1).to(tl.int64) * UNIT  # [BLOCK] uint8 pointers
            if MODE == 1:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {UNIT};\n\tmov.u32 $0, 0;",
                                          "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


def _units(nbytes: int, mode: int) -> tuple[int, int]:
    """(unit bytes, units covering nbytes) for mode. A bulk chunk must lie inside the tensor and every chunk of a
    launch has one size, so bulk mode rounds the count down: a tail under BULK_BYTES is left to the GEMV."""
    if mode == MODE_BULK:
        return BULK_BYTES, nbytes // BULK_BYTES
    return LINE_BYTES, -(-nbytes // LINE_BYTES)


def prefetch_bytes(tensor: torch.Tensor, nbytes: int | None = None, mode: int = MODE_LINES,
                   num_programs: int = _DEFAULT_PROGRAMS, marks: torch.Tensor | None = None) -> None:
    """Launch prefetches of the first nbytes (default: all) of a contiguous tensor on the current stream, in mode;
    MODE_RECORD sets marks[i] = 1 for every line i it would prefetch instead (marks: uint8, one per line)."""
    if not tensor.is_contiguous():
        raise ValueError("only a contiguous tensor's bytes can be prefetched")
    total = tensor.numel() * tensor.element_size()
    nbytes = total if nbytes is None else min(nbytes, total)
    if nbytes < 0 or num_programs < 1:
        raise ValueError(f"nbytes must be >= 0 and num_programs >= 1, got {nbytes}, {num_programs}")
    if mode not in (MODE_RECORD, MODE_LINES, MODE_BULK):
        raise ValueError(f"unknown prefetch mode {mode}")
    unit, num_units = _units(nbytes, mode)
    if mode == MODE_RECORD:
        if marks is None or marks.dtype != torch.uint8 or marks.numel() < num_units:
            raise ValueError(f"MODE_RECORD needs a uint8 marks tensor of >= {num_units} entries")
    if num_units == 0:
        return
    per_program = -(-num_units // num_programs)
    grid = (-(-num_units // per_program),)
    raw = tensor.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[grid](raw, num_units, per_program, marks if marks is not None else raw, UNIT=unit,
                              BLOCK=_BLOCK, MODE=mode, num_warps=4)


def reference_lines(nbytes: int) -> torch.Tensor:
    """The lines a MODE_LINES prefetch of nbytes covers, as MODE_RECORD marks them: every line that holds one of
    the bytes, each once."""
    return torch.ones(-(-nbytes // LINE_BYTES), dtype=torch.uint8)


@dataclass
class _Scope:
    mode: int
    extra_bytes: int  # bytes past a request's first tensor a layer may ask for
    streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)  # device index -> side stream used


_SCOPE: ContextVar[_Scope | None] = ContextVar("pagoda_l2_prefetch_scope", default=None)


@functools.lru_cache(maxsize=16)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


@functools.lru_cache(maxsize=16)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def setting() -> int:
    """PAGODA_L2_PREFETCH: 0 off (the default until measured); lines or bulk."""
    value = os.environ.get("PAGODA_L2_PREFETCH", "0")
    return {"0": 0, "off": 0, "lines": MODE_LINES, "1": MODE_LINES, "bulk": MODE_BULK}.get(value, MODE_LINES)


def extra_bytes_setting(default_mb: float) -> int:
    return int(float(os.environ.get("PAGODA_L2_PREFETCH_MB", default_mb)) * (1 << 20))


def supported(device: torch.device) -> bool:
    """CUDA sm90+ (bulk prefetch, and the L2 these sizes were measured on), not the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def scope(enabled: bool, default_extra_mb: float = 0.0) -> Iterator[None]:
    """Inside, `prefetch` calls launch on the side stream (if enabled and PAGODA_L2_PREFETCH allows); on exit the
    step's current stream waits for every side stream used."""
    mode = setting() if enabled else 0
    state = _Scope(mode, extra_bytes_setting(default_extra_mb)) if mode else None
    token = _SCOPE.set(state)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        if state is not None:
            for stream in state.streams.values():
                torch.cuda.current_stream(stream.device).wait_stream(stream)


def active() -> bool:
    """Whether `prefetch` would launch now (an enabled scope is open): callers skip gathering tensors otherwise."""
    return _SCOPE.get() is not None


def prefetch(tensors: Sequence[torch.Tensor | None]) -> None:
    """Prefetch the tensors' bytes into L2 on the side stream, forked from the current stream now: the first
    tensor whole, the rest up to the scope's extra-byte budget (in order). A no-op outside an enabled scope and off
    sm90 CUDA."""
    state = _SCOPE.get()
    present = [t for t in tensors if t is not None]
    if state is None or not present or not supported(present[0].device):
        return
    device = present[0].device
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = state.streams.get(index)
    if side is None:
        side = state.streams[index] = _side_stream(index)
    side.wait_stream(torch.cuda.current_stream(device))
    budget = state.extra_bytes
    with torch.cuda.stream(side):
        for position, tensor in enumerate(present):
            size = tensor.numel() * tensor.element_size()
            if position == 0:
                prefetch_bytes(tensor, size, state.mode)
                continue
            if budget <= 0:
                break
            prefetch_bytes(tensor, min(size, budget), state.mode)
            budget -= size
