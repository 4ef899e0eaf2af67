"""The launcher's restart policy: a process that served a while is replaced at once; replacements that keep
failing at start are retried after a growing delay, during which the console shows the process restarting
and the supervisor still notices other failures. Engine replicas (data parallel) follow the same policy, with
their longer start counted in."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from pagoda import launcher
from pagoda.launcher import (
    CHOSEN_PORTS_LOW,
    EPHEMERAL_RANGE,
    MAX_RESTART_DELAY_S,
    REPLICA_QUICK_FAILURE_S,
    Child,
    Launcher,
    ReplicaBackoff,
    free_ports,
    restart_delay,
)


def _exited_process(code: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    process.wait()
    return process


def _launcher() -> Launcher:
    """A launcher whose spawns are processes that have already exited with code 2 (a tokenizer without its folder)."""
    launcher = object.__new__(Launcher)  # no configs, no runtime dir: only the supervision bookkeeping is used
    launcher.children = []
    launcher.down_replicas = set()
    launcher.replica_backoff = ReplicaBackoff()
    launcher.server_config = SimpleNamespace(data_parallel_size=2, restart_on_failure=True)  # type: ignore[assignment]
    launcher.engine_config = SimpleNamespace(tensor_parallel_size=1)  # type: ignore[assignment]

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


def test_replica_backoff_policy() -> None:
    backoff = ReplicaBackoff()
    assert backoff.failed(1, 0, 5.0, 100.0) == 0.0  # the first failure, however soon: restarted at once
    assert backoff.failed(1, 1, 3600.0, 200.0) == 0.0  # a restart that served an hour: at once again
    delays = [backoff.failed(1, n, REPLICA_QUICK_FAILURE_S - 1, 300.0) for n in (2, 3, 4)]
    assert delays == [1.0, 2.0, 4.0] and backoff.quick_failures[1] == 3 and backoff.num_restarts[1] == 5
    assert backoff.due(303.99) is None and backoff.due(304.0) == 1 and backoff.due(304.0) is None
    assert backoff.failed(0, 1, 1.0, 0.0) == 1.0 and backoff.quick_failures.get(1) == 3  # per replica


def test_a_replica_failing_at_start_waits_down_then_comes_back() -> None:
    launcher = _launcher()
    launcher.start_replica(0)
    launcher.start_replica(1)
    for child in launcher.children:
        child.started_at = time.time() - 3600  # both served an hour
    failed = next(c for c in launcher.children if c.replica == 1 and c.module == "worker")
    assert launcher.replica_failed(failed, "exited with code 2", 10.0)
    assert launcher.down_replicas == set()  # restarted at once
    restarted = [c for c in launcher.children if c.replica == 1]
    assert {c.name for c in restarted} == {"r1-worker0", "r1-scheduler"} and {c.num_restarts for c in restarted} == {1}
    assert launcher.replica_failed(restarted[0], "exited with code 2", 20.0)  # failed again right after its start
    assert launcher.down_replicas == {1} and not [c for c in launcher.children if c.replica == 1]
    assert {c.replica for c in launcher.children} == {0}  # replica 0 untouched
    assert launcher.replica_backoff.due(20.99) is None
    assert launcher.replica_backoff.due(21.0) == 1
    launcher.restart_replica(1)
    assert launcher.down_replicas == set()
    assert {c.num_restarts for c in launcher.children if c.replica == 1} == {2}


def test_a_max_model_len_past_the_models_context_is_refused_before_any_process_starts(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-model-len` beyond the model's context is known from its config: `pagoda serve` says so in one line and
    exits 2, as for a tensor-parallel size that does not divide its heads, instead of starting every process for the
    worker to fail (exit 1, 'start-up failed')."""
    from pagoda.cli import build_parser
    from pagoda.shared.shapes import SHAPES, resolve_max_model_len

    limit = SHAPES["tiny"].context_limit
    assert resolve_max_model_len(SHAPES["tiny"], None) == limit
    assert resolve_max_model_len(SHAPES["tiny"], limit) == limit
    args = build_parser().parse_args(["serve", "--shape", "tiny", "--max-model-len", str(limit + 1),
                                      "--runtime-dir", str(tmp_path)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err == f"pagoda: error: max_model_len {limit + 1} exceeds the model's context of {limit} tokens\n", err
    assert not list(tmp_path.glob("*.sock"))


def test_free_ports_are_below_the_kernels_ephemeral_range_and_skip_taken_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chosen ports never come from the range the kernel hands out for port-0 binds (a ZeroMQ wildcard bind took a
    port a moment after the tests chose it for another api's HTTP server), and a port in use is passed over."""
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(CHOSEN_PORTS_LOW <= port < ephemeral_low for port in ports), ports
    with socket.socket() as taken:  # a listening port among the first candidates is skipped
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        monkeypatch.setattr(random, "sample", lambda population, k: [ports[0], ports[1]] + [ports[2]] * (k - 2))
        assert free_ports(2) == [ports[1], ports[2]]
    monkeypatch.setattr(launcher, "CHOSEN_PORTS_LOW", ephemeral_low - 10)  # no room: the kernel's ports
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(port >= ephemeral_low for port in ports), ports


def _serve_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`pagoda serve ARGV` on the tiny dummy model: its exit code and what it wrote to stderr."""
    from pagoda.cli import build_parser

    args = build_parser().parse_args(["serve", "--shape", "tiny", *argv])
    code = args.func(args)
    return code, capsys.readouterr().err


def _no_start(self: Launcher) -> None:
    raise AssertionError("the launcher started its processes")


def test_a_port_another_server_listens_on_is_refused_before_any_process_starts(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The api processes bind their port with SO_REUSEPORT (to share it), which let a second `pagoda serve` of the
    same user bind a port a first one served: both started, and the kernel split the clients' connections between
    two servers (two models, two configurations). The launcher now finds the port taken and says so in one line,
    naming --port, before starting anything; a listener with SO_REUSEPORT (another pagoda) counts as taken."""
    monkeypatch.setattr(Launcher, "start", _no_start)
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as an api of another server binds it
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        code, err = _serve_exit(["--port", str(port), "--runtime-dir", str(tmp_path)], capsys)
    assert code == 2
    assert err.startswith(f"pagoda: error: --port {port}: ") and "in use" in err and err.count("\n") == 1, err


def test_a_host_that_does_not_resolve_is_refused_before_any_process_starts(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--host no.such.host.invalid started every process, and the api died with 'cannot serve: [Errno -2] Name or
    service not known', naming no flag; now one line naming --host, nothing started."""
    monkeypatch.setattr(Launcher, "start", _no_start)
    code, err = _serve_exit(["--host", "no.such.host.invalid", "--runtime-dir", str(tmp_path)], capsys)
    assert code == 2
    assert err.startswith("pagoda: error: --host 'no.such.host.invalid' ") and err.count("\n") == 1, err
