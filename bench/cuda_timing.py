"""Device time of a piece of GPU work as decode steps run it: replayed from a CUDA graph, no host gaps."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Median device time of `fn` replayed from a CUDA graph: fn runs once eagerly (compiles), is captured, then
    each of `reps` timings replays it 5 times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm the graph pool's allocations on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 5)
    return sorted(times)[len(times) // 2]


_L2_FLUSH: list[torch.Tensor] = []


def flushed_time_ms(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median CUDA-event time of one call of `fn` after `warmup` calls, L2 wiped before each timed call (an H200's
    50 MB L2 would otherwise hold a small weight or cache between calls and flatter it)."""
    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        _L2_FLUSH[0].zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
