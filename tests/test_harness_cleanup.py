"""The servers tests start end with the test process, even when it is killed: a pytest worker killed for memory
must not leave its server running (xdist replaces the worker, which starts another)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed() -> None:
    code = ("import subprocess, sys, time; from tests.harness import die_with_parent; "
            "child = subprocess.Popen(['sleep', '120'], preexec_fn=die_with_parent); "
            "print(child.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()  # SIGKILL: no cleanup code of the parent runs
    parent.wait()
    wait_until(lambda: not _alive(child), 10.0, "the child to end with its parent")
