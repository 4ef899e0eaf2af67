"""Which device the worker runs on: the one place that asks torch (shared/config.py never imports it)."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError

log = logging.getLogger(__name__)
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def resolve_device(config: EngineConfig) -> str:
    """config.device, or for "auto" cuda when torch sees a GPU, else cpu. A CUDA device where torch sees none is
    a ConfigError naming device (torch's own was an AssertionError from deep in the model's loading)."""
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise ConfigError(f"--device {config.device}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                          f"{build}); use --device cpu, or auto", param="device")
    return config.device


def served_cpu_threads(num_cpus: int, num_local_ranks: int, env: Mapping[str, str]) -> int | None:
    """torch's intra-op threads for one CPU worker rank of a server: the CPUs this process may use less one (kept
    for the api, tokenizer and scheduler processes, the clients and the OS), shared by the host's ranks; None
    where OMP_NUM_THREADS decides (the operator's, or the launcher's for data-parallel replicas). torch's default,
    one thread a core, left no core to the other processes: its OpenMP threads spin after each op and an op
    waits for its slowest thread, so one descheduled thread stalls every op of the step. On the 2-core host
    (bench/RESULTS.md, CPU, forty-first session) 2 threads cost about twice the worker CPU a token of 1 and fell
    to a third of its speed whenever other work shared the host; on an idle host they streamed ~8% more at 8
    streams (OMP_NUM_THREADS=2 keeps them)."""
    if "OMP_NUM_THREADS" in env:
        return None
    return max(1, (num_cpus - 1) // max(1, num_local_ranks))


def limit_served_cpu_threads(config: EngineConfig) -> None:
    """In a served CPU worker (not the in-process engine, whose scheduler shares its thread): at most
    served_cpu_threads intra-op threads."""
    if resolve_device(config) != "cpu":
        return
    threads = served_cpu_threads(len(os.sched_getaffinity(0)), config.tensor_parallel_size, os.environ)
    if threads is not None and threads < torch.get_num_threads():
        log.info("CPU worker: %d intra-op thread(s) of %d (one CPU left to the other processes; "
                 "OMP_NUM_THREADS overrides)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def _num_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def page_locked_empty(shape: tuple[int, ...], dtype: torch.dtype,
                      register: Callable[[int, int], int] | None = None,
                      unregister: Callable[[int], int] | None = None) -> torch.Tensor:
    """An uninitialised host tensor that CUDA copies treat as pinned (asynchronous): plain pages page-locked by
    cudaHostRegister, which took 4.3 s for 16 GiB on the H200 host against 9.7 s for torch's pinned allocator
    (bench/results/s31, pin_probe16.py). The pages are unregistered before they are freed (a finalizer on the numpy
    array that owns them, run before numpy frees its buffer). Where registering is refused, torch's pinned
    allocator. register / unregister: the runtime's calls (tests pass fakes)."""
    register = register or _cuda_host_register
    unregister = unregister or _cuda_host_unregister
    nbytes = _num_bytes(shape, dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    pages = np.empty(nbytes, dtype=np.uint8)  # untouched until registered (the kernel maps it lazily)
    address = pages.ctypes.data
    code = register(address, nbytes)
    if code != 0:
        log.warning("cudaHostRegister refused %d bytes (cudaError %d): torch's pinned allocator instead", nbytes, code)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(pages, unregister, address)
    return torch.from_numpy(pages).view(dtype).view(shape)


PAGE_BYTES = 4096


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, except on the CPU: there the pages come zeroed from the OS (numpy's calloc; a large block is a
    fresh mapping) and are touched only where the tensor is used, so a KV cache costs nothing until its blocks are
    written (torch.zeros writes every byte first: ~0.25 s for 512 MiB on a 2-core host)."""
    nbytes = _num_bytes(shape, dtype)
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -pages.ctypes.data % PAGE_BYTES  # calloc's block starts 16 bytes into a page: aligned as torch's are
    return torch.from_numpy(pages[start:start + nbytes]).view(dtype).view(shape)


def _cuda_host_register(address: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE))


def _cuda_host_unregister(address: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(address))


class CompileWatch:
    """Counts the Triton compiles that happen after start-up. The warm-ups compile every kernel variant serving
    launches, so each one counted here is a launch shape they missed: it stalls the step it lands in (0.1-1.3 s on
    an H200) and is logged as a warning with the kernel's name and its time. One per process: installing it
    replaces Triton's process-wide JIT hooks (CUDA only; the interpreter compiles nothing)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.compiles: list[tuple[str, float]] = []  # (kernel name, seconds)
        self._started = 0.0

    def install(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **hook_args: Any) -> bool:
        self._started = time.perf_counter()
        return False  # a true value would make Triton skip the compile

    def _after(self, **hook_args: Any) -> bool:
        seconds = time.perf_counter() - self._started
        name = getattr(hook_args.get("fn"), "name", "?")
        self.compiles.append((name, seconds))
        self.log.warning("Triton compiled %s while serving (%.0f ms): a launch shape the start-up warm-up missed",
                         name, 1e3 * seconds)
        return False
