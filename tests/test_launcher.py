"""The launcher's restart policy: a process that served a while is replaced at once; replacements that keep
failing at start are retried after a growing delay, during which the console shows the process restarting
and the supervisor still notices other failures."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pagoda.launcher import MAX_RESTART_DELAY_S, Child, Launcher, restart_delay


def _exited_process(code: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    process.wait()
    return process


def _launcher() -> Launcher:
    """A launcher whose spawns are processes that have already exited with code 2 (a tokenizer without its folder)."""
    launcher = object.__new__(Launcher)  # no configs, no runtime dir: only the supervision bookkeeping is used
    launcher.children = []

    def spawn(name: str, module: str, replica: int | None = None, **overrides: object) -> None:
        launcher.children.append(Child(name, _exited_process(2), module, dict(overrides), replica=replica))

    launcher._spawn = spawn  # type: ignore[method-assign]
    return launcher


def test_restart_delay_doubles_up_to_its_cap() -> None:
    delays = [restart_delay(n) for n in range(10)]
    assert delays[:4] == [0.0, 1.0, 2.0, 4.0]
    assert delays == sorted(delays) and max(delays) == MAX_RESTART_DELAY_S
    with pytest.raises(AssertionError):
        restart_delay(-1)


def test_replacements_failing_at_start_back_off_and_a_long_run_resets_the_delay() -> None:
    launcher = _launcher()
    launcher.children.append(Child("api0", _exited_process(1), "api", started_at=time.time() - 3600))
    now = 1000.0
    # the original served an hour: replaced at once
    launcher.schedule_restart(launcher.dead_child(), "exited with code 1", now)  # type: ignore[arg-type]
    [first] = launcher.children
    assert first.num_restarts == 1 and first.restart_due is None
    for quick, delay in ((1, 1.0), (2, 2.0), (3, 4.0)):
        failed = launcher.dead_child()
        assert failed is launcher.children[0]
        launcher.schedule_restart(failed, "exited with code 2", now)
        assert (failed.quick_failures, failed.restart_due) == (quick, now + delay)
        assert launcher.dead_child() is None  # waiting: not a new failure
        assert launcher.due_restart(now + delay - 0.01) is None
        assert launcher.due_restart(now + delay) is failed
        launcher.restart(failed, failed.failure)
        [replacement] = launcher.children
        assert (replacement.num_restarts, replacement.quick_failures, replacement.restart_due) == (quick + 1, quick,
                                                                                                  None)
        now += delay
    launcher.children[0].started_at = time.time() - 60  # this replacement served a minute before it failed
    launcher.schedule_restart(launcher.children[0], "exited with code 2", now)
    [fresh] = launcher.children
    assert fresh.num_restarts == 5 and fresh.quick_failures == 0 and fresh.restart_due is None


def test_a_failure_elsewhere_is_seen_while_a_replacement_waits() -> None:
    launcher = _launcher()
    waiting = Child("tokenizer0", _exited_process(2), "tokenizer", num_restarts=1)
    launcher.children.append(waiting)
    launcher.schedule_restart(waiting, "exited with code 2", 50.0)
    assert waiting.restart_due == 51.0
    worker = Child("worker0", _exited_process(-9 % 256), "worker", replica=0)
    launcher.children.append(worker)
    assert launcher.dead_child() is worker
