"""Programmatic dependent launch (PDL, Hopper and later) for single-token decode chains.

At batch 1 a decode step is a chain of ~12 short kernels a layer, each a pure weight read or a latency-bound
pass over one row; between two of them the GPU drains one grid and ramps the next, ~400 times a step. A kernel
launched with PDL may start while the kernel before it in the stream is still running, once every program of
that kernel has executed `launch_dependents` (or exited). A kernel in the chain therefore:

1. calls `launch_dependents(USE_PDL)` first: the next kernel may be scheduled as soon as all of this one's
   programs are resident;
2. calls `wait(USE_PDL)` before it reads anything an earlier kernel wrote and before it writes anything:
   griddepcontrol.wait returns once the previous grid has completed and its memory is visible. Every PDL kernel
   waits unconditionally, so completion is transitive along the chain.

(PAGODA_PDL_TRIGGER=exit leaves step 1 out: each program then triggers when it exits, so the next kernel only
overlaps this one's tail.) Kernels not launched with PDL (cuBLAS, torch) are serialised as usual.

Where it pays was measured on an H200 (bench/RESULTS.md, thirteenth session): decode steps of one token whose
chains are mostly these Triton kernels (FP8 weight-only linears, MoE GEMVs and MLA) gain 5-6%; a Triton kernel
between two cuBLAS GEMVs (a bf16 dense model) loses ~1.5 us, and at 2-8 tokens with FP8 weights the whole chain
under PDL is ~15% slower. So the model opens a `scope` only for those steps (CausalLM.forward), and kernels
launch with PDL only inside one. Off on CPU (the interpreter), before sm90, and with PAGODA_PDL=0;
PAGODA_PDL=force opens every step's scope (for measuring).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_IN_SCOPE: ContextVar[bool] = ContextVar("pagoda_pdl_scope", default=False)


@functools.lru_cache(maxsize=16)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """CUDA sm90+, not the interpreter, not PAGODA_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAGODA_PDL") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Kernels launched inside launch with PDL when `on` (and their device supports it)."""
    token = _IN_SCOPE.set(on)
    try:
        yield
    finally:
        _IN_SCOPE.reset(token)


def forced() -> bool:
    """PAGODA_PDL=force: every step opens its scope, whatever the model would choose (measurements)."""
    return os.environ.get("PAGODA_PDL") == "force"


def active(device: torch.device) -> int:
    """How a kernel launched now on `device` uses PDL, its USE_PDL: 0 not at all; 1 launched with PDL,
    triggering its dependents first; 2 launched with PDL, triggering at exit (PAGODA_PDL_TRIGGER=exit)."""
    if not _IN_SCOPE.get() or not supported(device):
        return 0
    return 2 if os.environ.get("PAGODA_PDL_TRIGGER") == "exit" else 1


def launch_kwargs(use_pdl: int) -> dict[str, bool]:
    """Extra launch options for a kernel[grid](...) call: {"launch_pdl": True} or nothing."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL == 1:
        gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    if USE_PDL > 0:
        gdc_wait()
