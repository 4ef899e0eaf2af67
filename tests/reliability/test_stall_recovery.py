"""A scheduler stopped (SIGSTOP) past --heartbeat-timeout while the launcher's process group is left orphaned.

The kernel sends SIGHUP + SIGCONT to every process of a group that becomes orphaned (the last member whose parent
is outside the group, in the same session, goes away: here the launcher's parent exits) while one of its members is
stopped. The children used to share the launcher's group: all but the api (which takes SIGHUP as "reload keys")
died of it, and the launcher stopped naming an innocent "tokenizer0 exited with code -1". Each child now leads a
group of its own; the stopped scheduler is what the launcher finds, and it stops the server as designed
(docs/operations.md, Hangs and failures): in-flight requests fail, one line names the hung scheduler.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.harness import free_port, service_children, wait_until
from tests.reliability.harness import Server, StreamOutcome, stream_completion

pytestmark = [pytest.mark.slow]

START_TIMEOUT_S = 300.0

# The launcher's parent: starts `pagoda serve` in a process group of its own (as a shell with job control does, or
# `timeout`), prints its pid, and exits when its stdin closes, leaving that group orphaned.
PARENT = """
import subprocess, sys
launcher = subprocess.Popen(sys.argv[1:], stdout=sys.stderr, stderr=subprocess.STDOUT, process_group=0)
print(launcher.pid, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_stopped_scheduler_in_an_orphaned_group_stops_the_server_naming_it(smollm2_dir: Path) -> None:
    port = free_port()
    runtime_dir = Path(tempfile.mkdtemp(prefix="pgs", dir="/tmp"))
    log_path = runtime_dir / "serve.log"
    env = {"OMP_NUM_THREADS": "1", **{k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}}
    command = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(smollm2_dir), "--port", str(port),
               "--runtime-dir", str(runtime_dir), "--max-model-len", "1024", "--heartbeat-timeout", "3",
               "--no-console"]
    with open(log_path, "wb") as log:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, *command], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, env=env)
    assert parent.stdout is not None and parent.stdin is not None
    launcher_pid = int(parent.stdout.readline())
    server = Server(parent, port, runtime_dir, log_path)
    children: list[int] = []
    try:
        wait_until(lambda: "pagoda: serving" in server.log() or not _alive(launcher_pid), START_TIMEOUT_S,
                   "the server to start", interval=0.2)
        assert _alive(launcher_pid), server.log()[-4000:]
        found = service_children(launcher_pid, live_only=True)
        children = [pid for pids in found.values() for pid in pids]
        assert all(os.getpgid(pid) == pid for pid in children), "each child leads a process group of its own"

        outcomes: list[StreamOutcome] = []
        body = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True}
        client = threading.Thread(target=lambda: outcomes.append(stream_completion(server, body, timeout=60)))
        client.start()
        wait_until(lambda: server.metrics().get("pagoda_num_requests_running", 0) >= 1, 60, "the request to run")

        [scheduler] = found["scheduler"]
        os.kill(scheduler, signal.SIGSTOP)
        parent.stdin.close()  # the launcher's parent exits: its group is orphaned with the scheduler stopped
        parent.wait(10)
        wait_until(lambda: not _alive(launcher_pid), 60, "the launcher to stop the server")
        client.join(60)

        text = server.log()
        assert "pagoda: scheduler has been stopped for over 3 s (hung); stopping" in text, text[-4000:]
        assert "exited with code" not in text, text[-4000:]
        [outcome] = outcomes
        assert outcome.error or outcome.status >= 500 or outcome.transport_error, outcome
    finally:
        with contextlib.suppress(ValueError, OSError):
            parent.stdin.close()
        for pid in [launcher_pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher_pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            parent.wait(10)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not any(_alive(pid) for pid in [launcher_pid, *children]), 20, "the processes to end")
        for pid in [launcher_pid, *children]:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(runtime_dir, ignore_errors=True)
