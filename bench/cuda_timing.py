"""Device time of a piece of GPU work as decode steps run it: replayed from a CUDA graph, no host gaps."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def graph_time_ms(calls: Callable[[], object] | Sequence[Callable[[], object]], reps: int = 20,
                  replays: int = 5) -> float:
    """Median device time of one call, replayed from a CUDA graph: the call (or each call of a list, back to back in
    one graph, e.g. one per copy of the inputs so that no call finds its data in L2) runs once eagerly (compiles), is
    captured, then each of `reps` timings replays the graph `replays` times; a list's time is divided by its length."""
    fns = list(calls) if isinstance(calls, Sequence) else [calls]

    def run_all() -> None:
        for fn in fns:
            fn()

    run_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run_all()  # warm the graph pool's allocations on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            run_all()
    torch.cuda.synchronize()

    def replay() -> None:
        for _ in range(replays):
            graph.replay()

    warm_up_clocks(replay)
    times = [event_time_ms(replay) / (replays * len(fns)) for _ in range(reps)]
    return sorted(times)[len(times) // 2]


WARM_MS = 100.0  # device time replayed before timing


def warm_up_clocks(fn: Callable[[], object], warm_ms: float = WARM_MS, max_calls: int = 10_000) -> None:
    """Run fn until warm_ms of device time has passed (at most max_calls times). After a compile the GPU sits idle
    and its clocks drop; timings of short work right after were ~10% slow (H200, 2026-12-04, kv_fp8_bench: the
    same launch 51.3 us as the first variant of a shape, 46.6 us later; bench/results/s22). With this warm-up the
    first variant of a shape still read ~3% slow (170.7 against 165.9 us): compare a candidate after its baseline."""
    spent, calls = 0.0, 0
    while spent < warm_ms and calls < max_calls:
        spent += event_time_ms(fn)
        calls += 1


def event_time_ms(fn: Callable[[], object]) -> float:
    """Device time of one call of `fn`, between two CUDA events on the current stream (waits for the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


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
        times.append(event_time_ms(fn))
    return sorted(times)[len(times) // 2]


_SLEEP_CYCLES_PER_MS: list[float] = []


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` on this device, measured once."""
    if not _SLEEP_CYCLES_PER_MS:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # warm
        torch.cuda.synchronize()
        _SLEEP_CYCLES_PER_MS.append(cycles / event_time_ms(lambda: torch.cuda._sleep(cycles)))
    return _SLEEP_CYCLES_PER_MS[0]


def queued_time_ms(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> tuple[float, float]:
    """(median device time, host time) of one call of `fn` as a forward that is not captured in a graph runs it:
    with the host ahead of the device. Before each timed call the stream gets a spin of several times the call's
    host time, so every launch of `fn` is queued before the device reaches it and the events measure the kernels
    alone, not the Python between them (`flushed_time_ms` measures whichever is longer). A call that synchronizes
    with the device shows as a device time near the spin's: the host time is returned so callers can tell."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    lead_cycles = int(_sleep_cycles_per_ms() * max(4.0 * host_ms, 2.0))
    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    times = []
    for _ in range(iters):
        _L2_FLUSH[0].zero_()
        torch.cuda._sleep(lead_cycles)
        times.append(event_time_ms(fn))
    return sorted(times)[len(times) // 2], host_ms
