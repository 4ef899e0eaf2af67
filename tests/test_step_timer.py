"""StepTimer (benchmarks' decode GPU busy fraction): a deferred step's idle gap between forward and sampling."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.services.worker.model_runner import StepTimer


@dataclass(eq=False)
class FakeEvent:
    """A recorded device event at time `ms` (what torch.cuda.Event.elapsed_time reads)."""

    ms: float

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


def two_steps(gap_ms: float) -> StepTimer:
    """Decode steps of 4 ms device work each, back to back on the device; the second's sampling waited
    gap_ms after its forward (it ends gap_ms later)."""
    timer = StepTimer()
    first_end = FakeEvent(4.0)
    timer.steps.append((True, FakeEvent(0.0), first_end))
    second_end = FakeEvent(8.0 + gap_ms)
    timer.steps.append((True, FakeEvent(4.0), second_end))
    if gap_ms:
        timer.deferred[id(second_end)] = (FakeEvent(7.0), FakeEvent(7.0 + gap_ms))  # forward end, sampling start
    return timer


def test_busy_fraction_counts_the_gap_before_deferred_sampling_as_idle() -> None:
    fraction, count = two_steps(0.0).decode_busy_fraction()
    assert count == 1 and fraction == 1.0
    fraction, _ = two_steps(2.0).decode_busy_fraction()
    assert abs(fraction - 4.0 / 6.0) < 1e-9  # 4 ms of work in the 6 ms between the two ends
    summary = two_steps(2.0).summary()
    assert summary["sampling_gap_ms_mean"] == 2.0 and summary["deferred_steps"] == 1
    assert summary["decode_step_gpu_ms_p50"] == 4.0


def test_host_wait_per_step() -> None:
    timer = StepTimer(host_wait_s=0.003, host_waits=2)
    assert abs(timer.summary()["host_wait_ms_per_step"] - 1.5) < 1e-9
