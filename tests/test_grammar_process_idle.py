"""The grammar process costs nothing while no request is constrained: the runner waits for the process to build its
tokenizer before it reports ready (its start-up CPU is spent then, not during the first requests), the
idle process's main thread blocks in a read of its socket (no polling loop), unconstrained steps send it nothing,
and its module does not import torch's compiler stack (llguidance.torch's @torch.compile did: ~3 s of CPU at every
start)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.services.worker.grammar_process import MaskProcess, TokenizerSpec
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan

# read(2)'s syscall number, as /proc/<pid>/task/<tid>/syscall shows it
READ_NR = {"x86_64": 0, "aarch64": 63}


@pytest.fixture(scope="module")  # one process for the module: starting one costs ~3 s of CPU
def idle_process(smollm2_dir: Path) -> Iterator[MaskProcess]:
    rows = MaskProcess(TokenizerSpec(str(smollm2_dir), 49152, (2,)), max_rows=4)
    assert rows.wait_started()  # as the runner does once its own start-up is done
    yield rows
    rows.close()


def conn_fd(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--conn-fd") + 1])


def thread_syscalls(pid: int) -> dict[int, list[str]]:
    """Each thread's current system call: [number, args...] as /proc shows them ('running' when on a CPU)."""
    calls = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            calls[int(tid)] = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
    return calls


def blocked_in_read(pid: int, fd: int, read_nr: int) -> bool:
    fields = thread_syscalls(pid).get(pid, ["running"])
    return fields[0] == str(read_nr) and int(fields[1], 16) == fd


def test_wait_started_returns_once_the_process_has_built_its_tokenizer(idle_process: MaskProcess) -> None:
    child = idle_process._child
    assert child is not None and child.started and child.alive()
    assert not child.conn.poll(0)  # MaskStarted was read here; the process says nothing more unasked


@pytest.mark.skipif(platform.machine() not in READ_NR, reason="syscall numbers known for x86_64 and aarch64")
def test_an_idle_process_blocks_in_a_read_of_its_socket(idle_process: MaskProcess,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    read_nr = READ_NR[platform.machine()]
    pid = idle_process.pid
    assert pid is not None
    fd = conn_fd(pid)
    sent: list[object] = []
    monkeypatch.setattr(idle_process, "_send", lambda message: sent.append(message) or True)
    # unconstrained steps: a new request, its tokens, a fill, its end: nothing goes to the process
    new = NewRequest(7, [1, 2, 3], 2, [0], 0, SamplingParams(temperature=0.7, top_p=0.95), 0)
    idle_process.apply(StepPlan(0, [7], [1], new_requests=[new]))
    idle_process.accept([7], [5])
    assert idle_process.submit([([7], [6])], [7]).result() is None
    idle_process.drop([7])
    assert sent == []
    # The process reaches its read soon after MaskStarted; waiting for that is not what is asserted.
    deadline = time.monotonic() + 30.0
    while not blocked_in_read(pid, fd, read_nr) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The main thread sleeps in read(conn) (a message or EOF wakes it): it does not poll for work. Other threads
    # belong to libraries (tokenizers' and llguidance's pools), whose waits are theirs to time.
    calls = thread_syscalls(pid)
    assert calls[pid][0] == str(read_nr) and int(calls[pid][1], 16) == fd, calls
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"


def test_the_grammar_process_module_leaves_out_torchs_compiler() -> None:
    code = ("import sys, pagoda.services.worker.grammar_process; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
