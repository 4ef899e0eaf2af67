"""Programmatic dependent launch (PDL, Hopper and later) for small-batch decode chains.

At batch 1 a decode step is a chain of ~12 short kernels a layer, each a pure weight read or a latency-bound
pass over one row; between two of them the GPU drains one grid and ramps the next, ~400 times a step. A kernel
launched with PDL may start while the kernel before it in the stream is still running, once every program of
that kernel has executed `launch_dependents` (or exited). A kernel in the chain therefore:

1. in mode FIRST calls `launch_dependents(USE_PDL)` first: the next kernel may be scheduled as soon as all of
   this one's programs are resident (in mode AT_EXIT each program triggers as it exits: the next kernel only
   overlaps this one's tail);
2. calls `wait(USE_PDL)` before it reads anything an earlier kernel wrote and before it writes anything:
   griddepcontrol.wait returns once the previous grid has completed and its memory is visible. Every PDL kernel
   waits unconditionally, so completion is transitive along the chain.

Kernels not launched with PDL (cuBLAS, torch) are serialised as usual.

Where it pays was measured on an H200 (bench/RESULTS.md, thirteenth session): single-token decode steps whose
chains are mostly these Triton kernels (FP8 weight-only linears, MoE GEMVs and MLA) gain 5-6% with the trigger
first; FP8 steps of 2-8 tokens lose ~16% with it but gain ~2% with the trigger at exit (AT_EXIT); a Triton kernel
between two cuBLAS GEMVs (a bf16 dense model) loses ~1.5 us either way. So the model picks the mode a step opens
its `scope` with (CausalLM.pdl_mode), and kernels launch with PDL only inside one. Off on CPU (the
interpreter), before sm90, and with PAGODA_PDL=0; PAGODA_PDL=force opens every step's scope (for measuring).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagoda.shared.config import measurement_switch, triton_interpreted

_IN_SCOPE: ContextVar[int] = ContextVar("pagoda_pdl_scope", default=0)


@functools.lru_cache(maxsize=16)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """CUDA sm90+, not the interpreter, not PAGODA_PDL=0."""
    if device.type != "cuda" or triton_interpreted() or measurement_switch("PDL") == "0":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


FIRST, AT_EXIT = 1, 2  # when a PDL kernel lets its dependents launch: before its work, or as its programs exit


@contextlib.contextmanager
def scope(mode: int) -> Iterator[None]:
    """Kernels launched inside launch with PDL in `mode` (0: without; FIRST; AT_EXIT) where their device
    supports it."""
    token = _IN_SCOPE.set(mode)
    try:
        yield
    finally:
        _IN_SCOPE.reset(token)


def forced() -> bool:
    """PAGODA_PDL=force: every step opens its scope, whatever the model would choose (measurements)."""
    return measurement_switch("PDL") == "force"


def active(device: torch.device) -> int:
    """How a kernel launched now on `device` uses PDL, its USE_PDL: 0 not at all; FIRST: launched with PDL,
    triggering its dependents before its work; AT_EXIT: triggering as its programs exit. The scope's mode, or
    AT_EXIT everywhere under PAGODA_PDL_TRIGGER=exit (measurements)."""
    mode = _IN_SCOPE.get()
    if not mode or not supported(device):
        return 0
    return AT_EXIT if measurement_switch("PDL_TRIGGER") == "exit" else mode


def launch_options(device: torch.device) -> dict[str, int | bool]:
    """What a kernel[grid](...) call on `device` adds to its arguments: the kernel's USE_PDL (active's mode) and,
    under PDL, the launch attribute."""
    mode = active(device)
    return {"USE_PDL": mode, "launch_pdl": True} if mode else {"USE_PDL": 0}


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    if USE_PDL == 1:
        gdc_launch_dependents()


@triton.jit
def wait(USE_PDL: tl.constexpr):
    if USE_PDL > 0:
        gdc_wait()
