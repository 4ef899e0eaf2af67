"""The hang verdict (pure logic) and wire checks the scheduler applies to its peers."""

from __future__ import annotations

from pagoda.services.scheduler.health import BOUND_FACTOR, WARMUP_BOUND_S, WARMUP_STEPS, StepWatch
from pagoda.services.scheduler.service import _columns_agree
from pagoda.shared.messages import PromptScores, StepResult


def test_bound_is_fixed_or_derived_with_a_floor() -> None:
    assert StepWatch(step_timeout=7.0, floor=30.0).bound() == 7.0
    watch = StepWatch(floor=2.0)
    assert watch.bound() == WARMUP_BOUND_S  # nothing measured yet: first steps may be slow
    for seconds in [0.01, 0.05, 0.02] * WARMUP_STEPS:
        watch.record(seconds)
    assert watch.bound() == 2.0  # fast steps: the floor holds
    watch.record(1.0)
    assert watch.bound() == BOUND_FACTOR * 1.0


def test_verdict() -> None:
    watch = StepWatch(floor=2.0)
    for _ in range(WARMUP_STEPS):
        watch.record(0.1)
    assert watch.verdict(100.0, None, -1, worker_last_seen=0.0, ready=False) == ""  # loading: no verdict
    assert watch.verdict(100.0, 99.0, 7, worker_last_seen=99.0, ready=True) == ""
    hung = watch.verdict(100.0, 97.5, 7, worker_last_seen=97.5, ready=True)
    assert "step 7" in hung and "2.5 s" in hung
    # idle: late heartbeats (a busy host) are no hang until the step bound passes
    assert watch.verdict(100.0, None, -1, worker_last_seen=98.5, ready=True) == ""
    assert "silent" in watch.verdict(100.0, None, -1, worker_last_seen=97.5, ready=True)
    slow = StepWatch(floor=30.0)
    for _ in range(WARMUP_STEPS):
        slow.record(0.1)
    assert slow.verdict(100.0, None, -1, worker_last_seen=80.0, ready=True) == ""  # 20 s without a heartbeat


def test_result_columns_must_agree() -> None:
    assert _columns_agree(StepResult(0, [1, 2], [5, 6]))
    assert _columns_agree(StepResult(0, [1, 2], [5, 6], [-0.1, -0.2], [[1], []], [[-0.5], []]))
    assert not _columns_agree(StepResult(0, [1, 2], [5]))
    assert not _columns_agree(StepResult(0, [1], [5], [-0.1, -0.2]))
    assert not _columns_agree(StepResult(0, [1], [5], [-0.1], [[1, 2]], [[-0.5]]))
    assert not _columns_agree(StepResult(0, [1], [5], prompt_scores=[PromptScores(1, 1, [3, 4], [-1.0], [], [])]))
