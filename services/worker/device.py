"""Which device the worker runs on: the one place that asks torch (shared/config.py never imports it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagoda.shared.config import EngineConfig


def resolve_device(config: EngineConfig) -> str:
    """config.device, or for "auto" cuda when torch sees a GPU, else cpu."""
    if config.device != "auto":
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"


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
