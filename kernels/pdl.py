"""Programmatic dependent launch (PDL, Hopper and later) for the small-batch decode chain.

At batch 1 a decode step is a chain of ~12 short kernels a layer, each a pure weight read or a latency-bound
pass over one row; between two of them the GPU drains one grid and ramps the next (~1-2 us each, ~400 times a
step). A kernel launched with PDL may start while the kernel before it in the stream is still running, once every
program of that kernel has executed `launch_dependents` (or exited). A kernel in the chain therefore:

1. calls `launch_dependents(USE_PDL)` first: the next kernel may be scheduled as soon as all of this one's
   programs are resident;
2. reads only data no earlier kernel writes (weights, norm weights) and prefetches its first weight tiles into L2;
3. calls `wait(USE_PDL)` before it reads anything an earlier kernel wrote and before it writes anything at all:
   griddepcontrol.wait returns once the previous grid has completed and its memory is visible. Every PDL kernel
   waits unconditionally, so completion is transitive along the chain.

Kernels not launched with PDL (cuBLAS, torch) are serialised as usual. On CPU (the interpreter), before sm90, or
with PAGODA_PDL=0 nothing changes: USE_PDL is False and `launch_kwargs` is empty.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LINE_BYTES = 128  # one L2 prefetch per cache line (the kernels write the literal)


@functools.lru_cache(maxsize=16)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA sm90+, not the interpreter, not PAGODA_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAGODA_PDL") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(use_pdl: bool) -> dict[str, bool]:
    """Extra launch options for a kernel[grid](...) call: {"launch_pdl": True} or nothing."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, USE_PDL: tl.constexpr):
    """Ask L2 for the lines at `ptrs` (one valid pointer per line: clamp out-of-range ones; nothing is read back).
    Only under PDL, where it runs before the previous kernel has finished."""
    if USE_PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
