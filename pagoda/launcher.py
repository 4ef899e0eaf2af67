"""`pagoda serve`: start every process on private ipc:// endpoints, wait until healthy, supervise, stop cleanly.

Start order: worker rank(s), scheduler, tokenizers, apis; the api's /health turns 200 only once all
of them answer. If any child dies the rest are stopped and the launcher exits non-zero (with
--restart-on-failure a tokenizer or api is replaced instead; replacements that keep failing at start are
retried after a growing delay). SIGTERM or
SIGINT stops the apis first (they finish or fail in-flight requests), then everything else; a child
still alive after SHUTDOWN_DEADLINE_S is killed. Children get SIGTERM if the launcher itself dies. Each child is
in a process group of its own: signals sent to the launcher's group (a terminal's) reach the launcher only.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import msgspec

from pagoda.services.tokenizer.generation_config import sampling_defaults
from pagoda.shared.config import EngineConfig, ServerConfig, to_env
from pagoda.shared.errors import ConfigError, PagodaError
from pagoda.shared.hf_tokenizer import TOKENIZER_FILES, has_tokenizer
from pagoda.shared.messages import PROCESS_TABLE_FILE, ProcessEntry, ProcessTable
from pagoda.shared.shapes import check_divisible, resolve_arch, resolve_max_model_len
from pagoda.shared.transport import ClusterKeys

SHUTDOWN_DEADLINE_S = 10.0
STARTUP_TIMEOUT_S = 900.0
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = [signal.SIGTERM, signal.SIGINT]


RESTARTABLE = ("tokenizer", "api")  # stateless per request: a fresh one serves new requests at once
QUICK_FAILURE_S = 10.0  # a replacement that fails sooner than this after its start is in a crash loop
# the same for a restarted engine replica, whose start loads the model and warms it up
REPLICA_QUICK_FAILURE_S = 300.0
MAX_RESTART_DELAY_S = 30.0


def restart_delay(quick_failures: int) -> float:
    """Seconds before the next replacement, after this many replacements in a row failed quickly: none while
    there is none (a process that served a while is replaced at once), then 1, 2, 4 ... up to MAX_RESTART_DELAY_S
    (a tokenizer folder that vanished would otherwise respawn a Python process every second while it is gone)."""
    assert quick_failures >= 0
    return 0.0 if quick_failures == 0 else min(MAX_RESTART_DELAY_S, 2.0 ** (quick_failures - 1))


@dataclass(slots=True)
class ReplicaBackoff:
    """Restart bookkeeping of engine replicas (--data-parallel-size with --restart-on-failure): a replica that served
    a while is restarted at once; restarts that fail again within REPLICA_QUICK_FAILURE_S wait restart_delay(n)."""

    quick_failures: dict[int, int] = field(default_factory=dict)  # replica -> quick failures in a row
    num_restarts: dict[int, int] = field(default_factory=dict)  # replica -> restarts so far, the pending one included
    restart_due: dict[int, float] = field(default_factory=dict)  # replica -> time.monotonic() of its restart

    def failed(self, replica: int, num_restarts: int, ran_s: float, now: float) -> float:
        """A replica that had been restarted num_restarts times failed after running ran_s seconds: the delay before
        its next start (0: now; else it is due at now + delay)."""
        quick = num_restarts > 0 and ran_s < REPLICA_QUICK_FAILURE_S
        self.quick_failures[replica] = self.quick_failures.get(replica, 0) + 1 if quick else 0
        self.num_restarts[replica] = num_restarts + 1
        delay = restart_delay(self.quick_failures[replica])
        if delay > 0:
            self.restart_due[replica] = now + delay
        return delay

    def due(self, now: float) -> int | None:
        """A replica whose delayed restart is due (forgotten here: the caller starts it)."""
        replica = next((r for r, at in self.restart_due.items() if at <= now), None)
        if replica is not None:
            del self.restart_due[replica]
        return replica


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen[bytes]
    module: str = ""
    overrides: dict[str, object] = field(default_factory=dict)
    stopped_since: float | None = None  # time.monotonic() when it was first seen stopped (SIGSTOP, a debugger)
    num_restarts: int = 0
    replica: int | None = None  # the engine replica a scheduler or worker belongs to
    started_at: float = field(default_factory=time.time)
    quick_failures: int = 0  # replacements in a row, up to this one, that failed within QUICK_FAILURE_S
    restart_due: float | None = None  # time.monotonic() when this failed child's replacement is spawned
    failure: str = ""  # why it is being replaced


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (R, S, D, T stopped, t traced, Z zombie), "" if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _die_with_parent() -> None:
    """Runs in the child before exec: unblock the signals the launcher blocks (children inherit the mask),
    and have the kernel send SIGTERM when the launcher dies (Linux)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS + [signal.SIGCHLD, signal.SIGHUP])
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


# free_ports draws from here up to the kernel's ephemeral range (below 1024 needs root; 1024-9999 holds many
# well-known services' ports)
CHOSEN_PORTS_LOW = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (all held open together while chosen), drawn
    at random below the kernel's ephemeral range. A port the kernel hands out itself (a bind to port 0, as a ZeroMQ
    wildcard bind; the local end of an outgoing connection) is never one chosen here and not yet bound by the
    process it was chosen for: when both came from that range, a service's wildcard bind took a port a moment
    after it was chosen for another's HTTP server ("address already in use")."""
    sockets: list[socket.socket] = []
    try:
        for port in _candidate_ports(count):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or, for port 0, nothing left: let it raise below)
                sock.close()
                if port == 0:
                    raise
                continue
            sockets.append(sock)
            if len(sockets) == count:
                return [int(held.getsockname()[1]) for held in sockets]
        raise OSError(f"no {count} free loopback ports")
    finally:
        for sock in sockets:
            sock.close()


def _candidate_ports(count: int) -> Iterator[int]:
    """Random ports from CHOSEN_PORTS_LOW up to the ephemeral range, then 0 (the kernel's choice) for what is
    still missing: where that range starts too low to leave room, or its ports are taken."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768  # Linux's default
    if ephemeral_low - CHOSEN_PORTS_LOW >= 64 * count:
        yield from random.sample(range(CHOSEN_PORTS_LOW, ephemeral_low), 16 * count)
    while True:
        yield 0
def visible_devices(visible: str | None) -> list[str]:
    """The GPUs the launcher may hand out: CUDA_VISIBLE_DEVICES, else the /dev/nvidiaN nodes (none on CPU)."""
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    nodes = sorted(int(p.name[len("nvidia"):]) for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit())
    return [str(n) for n in nodes]


def replica_devices(replica: int, tp_size: int, devices: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for replica `replica`'s ranks: devices r*T..r*T+T-1 of `devices`; with fewer
    devices than D x T the replicas wrap around and share them (then give each its --kv-cache-memory, see
    check_shared_gpus)."""
    if not devices:
        return ""
    return ",".join(devices[d % len(devices)] for d in range(replica * tp_size, (replica + 1) * tp_size))


def check_shared_gpus(engine_config: EngineConfig, data_parallel_size: int, devices: list[str]) -> None:
    """Replicas sharing a GPU need their KV cache size given: a worker sizes its cache from
    gpu_memory_utilization minus what other processes hold when it measures, so a replica that measures
    after another allocated its cache finds no room (and which one measures first is a race)."""
    num_ranks = data_parallel_size * engine_config.tensor_parallel_size
    if data_parallel_size == 1 or engine_config.device == "cpu" or not devices or len(devices) >= num_ranks:
        return
    if engine_config.kv_cache_memory is None and engine_config.num_kv_blocks is None:
        raise ConfigError(f"{data_parallel_size} replicas x {engine_config.tensor_parallel_size} rank(s) share "
                          f"{len(devices)} GPU(s): give each replica its KV cache size with --kv-cache-memory "
                          "(e.g. 40GiB each for two replicas of a small model on one 141 GB GPU)",
                          param="kv_cache_memory")


def check_tokenizer_files(engine_config: EngineConfig) -> None:
    """What the tokenizer processes read at their start: a --tokenizer folder without a tokenizer, or a
    --generation-config they cannot read, is a ConfigError naming it before any process starts (the tokenizer's
    own came once every process had started; the first named model)."""
    folder = engine_config.tokenizer
    if folder is not None and not has_tokenizer(folder):
        raise ConfigError(f"--tokenizer {folder!r}: no tokenizer there (a folder with {' or '.join(TOKENIZER_FILES)})",
                          param="tokenizer")
    sampling_defaults(engine_config.model, engine_config.generation_config, engine_config.generation_overrides())


def check_engine_config(engine_config: EngineConfig) -> EngineConfig:
    """Fail before any process starts on what can be known up front; pick a meeting address for the ranks."""
    tp_size = engine_config.tensor_parallel_size
    arch = resolve_arch(engine_config.model, engine_config.load_format)
    check_divisible(arch, tp_size)
    resolve_max_model_len(arch, engine_config.max_model_len)
    check_tokenizer_files(engine_config)
    if tp_size > 1 and engine_config.tp_init_address is None:
        engine_config = replace(engine_config, tp_init_address=f"tcp://127.0.0.1:{free_ports(1)[0]}")
    return engine_config


def check_http_address(host: str, port: int) -> None:
    """Fail before any process starts unless the api processes can listen on host:port: the host resolves to an
    address of this machine and no other server listens on the port. The apis bind it with SO_REUSEPORT, to share
    it, which lets a second server of the same user bind it too: both would serve, the kernel splitting the
    clients' connections between them. A bind without SO_REUSEPORT fails beside any listener."""
    try:  # as the apis' TCPSite resolves it ("": every interface)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} does not resolve: {exc.strerror}", param="host") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
            if family == socket.AF_INET6:  # as asyncio binds it: beside, not over, the IPv4 address
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"--host {host!r}: {address[0]} is no address of this machine to listen on",
                                      param="host") from None
                why = "in use (another server listens there)" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise ConfigError(f"--port {port}: cannot listen on {address[0]}:{port}: {why}",
                                  param="port") from None


def make_runtime_dir(given: str | None) -> Path:
    """The folder of the ipc:// sockets and the process table: the one given (made if missing), else a private
    new one. One that cannot be made is a ConfigError naming runtime_dir (it was the OSError's traceback)."""
    try:
        if given is None:
            return Path(tempfile.mkdtemp(prefix="pagoda-"))
        path = Path(given)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    except OSError as exc:
        what = f"--runtime-dir {given}" if given is not None else f"a runtime folder in {tempfile.gettempdir()}"
        raise ConfigError(f"cannot make {what}: {exc.strerror or exc}", param="runtime_dir") from None


RUNTIME_LOCK_FILE = "launcher.lock"  # held (flock) by the launcher using the runtime dir, for its whole life
METRICS_DIR = "prometheus"  # in the runtime dir: the api processes' Prometheus files (PROMETHEUS_MULTIPROC_DIR)


def lock_runtime_dir(runtime_dir: Path) -> BinaryIO:
    """Hold the runtime dir for this launcher (released when the returned file closes, or the process ends). A
    second launcher there would bind the first's ipc:// socket paths and, at its stop, delete its sockets and its
    apis' Prometheus files: a ConfigError naming runtime_dir, with the holder's pid."""
    lock = (runtime_dir / RUNTIME_LOCK_FILE).open("a+b")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().decode(errors="replace").strip() or "?"
        lock.close()
        raise ConfigError(f"--runtime-dir {runtime_dir} is in use by another pagoda serve (pid {holder}): give each "
                          "server a runtime dir of its own (or none: a private one is made)",
                          param="runtime_dir") from None
    lock.truncate(0)
    lock.write(str(os.getpid()).encode())
    lock.flush()
    return lock


def check_api_files(config: ServerConfig) -> None:
    """Open what the api processes open at their start (the usage log, the responses folder): one they cannot use
    is a ConfigError naming its flag, before any process starts (the api's 'cannot serve: [Errno 2] No such file or
    directory' named none, once every process had started)."""
    if config.usage_log:
        try:  # as services/api/tenants.UsageLog opens it
            os.close(os.open(config.usage_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
        except OSError as exc:
            raise ConfigError(f"--usage-log {config.usage_log}: cannot append to it: {exc.strerror}",
                              param="usage_log") from None
    folder = config.responses_folder()
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--responses-store-dir {folder}: cannot make it: {exc.strerror}",
                              param="responses_store_dir") from None


def uses_tcp(config: ServerConfig) -> bool:
    """Whether any ZeroMQ endpoint given is tcp:// (the derived ones are ipc://)."""
    given = [config.api_endpoints, config.scheduler_endpoint, config.plan_endpoint, config.result_endpoint,
             config.stats_endpoint, config.scheduler_endpoints, config.stats_endpoints, config.registry_endpoint]
    return any("tcp://" in value for value in given if value)


class Launcher:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.engine_config = check_engine_config(engine_config)
        check_http_address(server_config.host, server_config.port)
        check_shared_gpus(self.engine_config, server_config.data_parallel_size,
                          visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")))
        self.own_runtime_dir = server_config.runtime_dir is None
        self.runtime_dir = make_runtime_dir(server_config.runtime_dir)
        self._lock = lock_runtime_dir(self.runtime_dir)
        # the apis' Prometheus files: a launcher killed before its clean stop left its own, which the apis would
        # count as theirs
        shutil.rmtree(self.runtime_dir / METRICS_DIR, ignore_errors=True)
        self.server_config = replace(server_config, runtime_dir=str(self.runtime_dir))
        check_api_files(self.server_config)
        if self.server_config.cluster_key_dir is None and uses_tcp(self.server_config):
            # tcp endpoints on one host: a key pair of this launch, in the private runtime dir, for every process
            key_dir = self.runtime_dir / "keys"
            ClusterKeys.generate(key_dir)
            self.server_config = replace(self.server_config, cluster_key_dir=str(key_dir))
        self.children: list[Child] = []
        self.down_replicas: set[int] = set()
        self.replica_backoff = ReplicaBackoff()
        self._table_written = b""  # the process table's last contents (the console reads the file)
        tp_address = self.engine_config.tp_init_address
        self.replica_tp_address = [tp_address] + [  # each replica's ranks meet at their own address
            f"tcp://127.0.0.1:{free_ports(1)[0]}" if tp_address is not None else None
            for _ in range(1, self.server_config.data_parallel_size)]

    def _spawn(self, name: str, module: str, replica: int | None = None, **overrides: object) -> None:
        server = replace(self.server_config, **overrides)  # type: ignore[arg-type]
        engine = self.engine_config
        if replica is not None and engine.tp_init_address is not None and replica > 0:
            engine = replace(engine, tp_init_address=self.replica_tp_address[replica])
        env = {**os.environ, **to_env(engine, server)}
        if replica is not None and self.server_config.data_parallel_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Replicas share the cores: D workers with a thread per core each oversubscribe them (on CPU, the
            # threads' spin-waits made D=2 many times slower than D=1).
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.server_config.data_parallel_size))
        if replica is not None and self.server_config.data_parallel_size > 1 and engine.device != "cpu":
            devices = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = replica_devices(replica, engine.tensor_parallel_size, devices)
        if module == "api":
            metrics_dir = self.runtime_dir / METRICS_DIR
            metrics_dir.mkdir(exist_ok=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        # Each child leads a process group of its own, so that signals for the launcher's group reach the launcher
        # alone, which decides what they mean: a terminal's ^C (an ordered stop), a hangup (SIGHUP reloads keys),
        # and the kernel's SIGHUP + SIGCONT to a group left orphaned (the launcher's parent exited) while a member
        # is stopped, which killed every child but the api (exit code -1) when a SIGSTOPped scheduler shared it.
        process = subprocess.Popen([sys.executable, "-m", f"pagoda.services.{module}"], env=env,
                                   preexec_fn=_die_with_parent, process_group=0)
        self.children.append(Child(name, process, module, dict(overrides), replica=replica))

    def start(self) -> None:
        config = self.server_config
        for replica in range(config.data_parallel_size):
            self.start_replica(replica)
        for index in range(config.tokenizer_workers):
            self._spawn(f"tokenizer{index}", "tokenizer", tokenizer_id=f"tokenizer{index}-{os.getpid()}")
        for index in range(config.api_workers):
            self._spawn(f"api{index}", "api", api_index=index)

    def start_replica(self, replica: int) -> None:
        """Replica r's worker rank(s) and scheduler, on its own endpoints (names suffixed -r{r} when D > 1)."""
        prefix = f"r{replica}-" if self.server_config.data_parallel_size > 1 else ""
        for rank in range(self.engine_config.tensor_parallel_size):
            self._spawn(f"{prefix}worker{rank}", "worker", replica=replica, worker_rank=rank, replica_id=replica)
        self._spawn(f"{prefix}scheduler", "scheduler", replica=replica, replica_id=replica)

    def stop_replica(self, replica: int) -> list[Child]:
        """Kill what is left of one replica (its peers already see it silent) and forget its processes."""
        members = [child for child in self.children if child.replica == replica]
        for child in members:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
            self.children.remove(child)
        return members

    def replica_failed(self, failed: Child, why: str, now: float) -> bool:
        """With several replicas one replica's failure is not the server's: stop that replica, restart it with
        --restart-on-failure (it rejoins: tokenizers and apis reconnect; at once, or after a growing delay while
        its restarts keep failing within REPLICA_QUICK_FAILURE_S, down meanwhile), else serve on with the others.
        False when this does not apply (one replica) or no replica is left."""
        if failed.replica is None or self.server_config.data_parallel_size == 1:
            return False
        replica = failed.replica
        members = self.stop_replica(replica)
        if self.server_config.restart_on_failure:
            num_restarts = max(child.num_restarts for child in members)
            started = min(child.started_at for child in members)
            delay = self.replica_backoff.failed(replica, num_restarts, time.time() - started, now)
            if delay == 0:
                self.restart_replica(replica)
                print(f"pagoda: {failed.name} {why}; restarted replica {replica}", file=sys.stderr)
                return True
            self.down_replicas.add(replica)
            print(f"pagoda: {failed.name} {why} {time.time() - started:.1f} s after replica {replica} started "
                  f"({self.replica_backoff.quick_failures[replica]} quick failure(s) in a row); restarting it in "
                  f"{delay:g} s", file=sys.stderr)
            return True
        self.down_replicas.add(replica)
        alive = set(range(self.server_config.data_parallel_size)) - self.down_replicas
        print(f"pagoda: {failed.name} {why}; replica {replica} is down, serving on replica(s) "
              f"{sorted(alive) or 'none'}", file=sys.stderr)
        return bool(alive)

    def restart_replica(self, replica: int) -> None:
        """A fresh replica in place of a failed one (whose processes stop_replica removed)."""
        self.down_replicas.discard(replica)
        self.start_replica(replica)
        for child in self.children:
            if child.replica == replica:
                child.num_restarts = self.replica_backoff.num_restarts[replica]

    def wait_until_healthy(self) -> bool:
        url = f"http://{self._url_host()}:{self.server_config.port}/health"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.dead_child() is not None or _pending_stop():
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)  # polling an HTTP endpoint: there is nothing to wait on instead
        return False

    def dead_child(self) -> Child | None:
        """A child that died and is not already waiting for its replacement."""
        return next((child for child in self.children
                     if child.restart_due is None and child.process.poll() is not None), None)

    def due_restart(self, now: float) -> Child | None:
        return next((child for child in self.children
                     if child.restart_due is not None and child.restart_due <= now), None)

    def schedule_restart(self, child: Child, why: str, now: float) -> None:
        """Replace the child now, or after a delay when its replacements keep failing at start."""
        quick = child.num_restarts > 0 and time.time() - child.started_at < QUICK_FAILURE_S
        child.quick_failures = child.quick_failures + 1 if quick else 0
        delay = restart_delay(child.quick_failures)
        if delay == 0:
            self.restart(child, why)
            return
        if child.process.poll() is None:
            child.process.kill()  # stopped or hung: gone now, replaced later
            child.process.wait()
        child.restart_due, child.failure = now + delay, why
        print(f"pagoda: {child.name} {why} {time.time() - child.started_at:.1f} s after its start "
              f"({child.quick_failures} quick failure(s) in a row); restarting it in {delay:g} s", file=sys.stderr)

    def hung_child(self, now: float) -> Child | None:
        """A child stopped (SIGSTOP) for longer than the heartbeat timeout: its peers already gave up on it."""
        for child in self.children:
            if process_state(child.process.pid) in ("T", "t"):
                child.stopped_since = child.stopped_since or now
                if now - child.stopped_since > self.server_config.heartbeat_timeout:
                    return child
            else:
                child.stopped_since = None
        return None

    def restart(self, child: Child, why: str) -> None:
        """A fresh process in the child's place (tokenizer or api); its peers register it on its hello."""
        if child.process.poll() is None:
            child.process.kill()  # stopped or hung: SIGKILL works on a stopped process too
            child.process.wait()
        self.children.remove(child)
        started = time.monotonic()
        overrides = dict(child.overrides)
        if child.module == "tokenizer":  # a new identity: peers drop the old one's requests, not the new one's
            overrides["tokenizer_id"] = f"{child.name}-{os.getpid()}-r{child.num_restarts + 1}"
        self._spawn(child.name, child.module, **overrides)
        self.children[-1].overrides = child.overrides
        self.children[-1].num_restarts = child.num_restarts + 1
        self.children[-1].quick_failures = child.quick_failures
        print(f"pagoda: {child.name} {why}; restarted it (restart {child.num_restarts + 1}, "
              f"{time.monotonic() - started:.2f} s to spawn)", file=sys.stderr)

    def supervise(self) -> int:
        """Block until a signal, or a child's death or hang that the policy does not restart; return the exit
        code. With --restart-on-failure a dead or stopped tokenizer or api process is replaced."""
        while True:
            now = time.monotonic()
            due = self.due_restart(now)
            if due is not None:
                self.restart(due, due.failure)
                continue
            due_replica = self.replica_backoff.due(now)
            if due_replica is not None:
                self.restart_replica(due_replica)
                print(f"pagoda: restarted replica {due_replica}", file=sys.stderr)
                continue
            dead = self.dead_child()
            failed = dead or self.hung_child(now)
            if failed is not None:
                why = (f"exited with code {failed.process.returncode}" if failed is dead
                       else f"has been stopped for over {self.server_config.heartbeat_timeout:g} s (hung)")
                if self.server_config.restart_on_failure and failed.module in RESTARTABLE:
                    self.schedule_restart(failed, why, now)
                    continue
                if failed.replica is not None and self.server_config.data_parallel_size > 1:
                    if self.replica_failed(failed, why, now):
                        continue
                print(f"pagoda: {failed.name} {why}; stopping", file=sys.stderr)
                return 1
            self.write_process_table()
            info = signal.sigtimedwait(STOP_SIGNALS + [signal.SIGCHLD, signal.SIGHUP], 0.5)
            if info is not None and info.si_signo in STOP_SIGNALS:
                print("pagoda: stopping", file=sys.stderr)
                return 0
            if info is not None and info.si_signo == signal.SIGHUP:
                self.reload_keys()

    def reload_keys(self) -> None:
        """SIGHUP: the api processes read the keys file again (they also notice a change on their own)."""
        for child in self.children:
            if child.module == "api" and child.process.poll() is None:
                child.process.send_signal(signal.SIGHUP)

    def write_process_table(self) -> None:
        """The children as the console shows them, in the runtime dir; rewritten (atomically) when it changes."""
        if not self.server_config.console:
            return
        entries = [ProcessEntry(c.name, c.module, c.process.pid, c.started_at, c.num_restarts, c.replica,
                                c.stopped_since is not None,
                                restart_delay(c.quick_failures) if c.restart_due is not None else None)
                   for c in self.children]
        backoff = self.replica_backoff
        waiting = {replica: restart_delay(backoff.quick_failures[replica]) for replica in backoff.restart_due}
        table = ProcessTable(os.getpid(), 0.0, entries, sorted(self.down_replicas), waiting)
        data = msgspec.json.encode(table)
        if data == self._table_written:
            return
        path = self.runtime_dir / PROCESS_TABLE_FILE
        staging = path.with_suffix(".tmp")
        try:
            staging.write_bytes(msgspec.json.encode(msgspec.structs.replace(table, time=time.time())))
            staging.replace(path)
        except OSError as exc:  # the console then shows what the api sees itself; serving goes on
            print(f"pagoda: cannot write {path}: {exc}", file=sys.stderr)
        self._table_written = data

    def shutdown(self) -> None:
        """APIs first (they drain or fail in-flight requests), then the rest; kill stragglers at the deadline."""
        deadline = time.monotonic() + SHUTDOWN_DEADLINE_S
        apis = [c for c in self.children if c.name.startswith("api")]
        others = [c for c in self.children if not c.name.startswith("api")]
        self._terminate(apis)
        self._wait(apis, min(deadline, time.monotonic() + self.server_config.shutdown_grace + 3.0))
        self._terminate(others)
        self._wait(self.children, deadline - 0.5)
        for child in self.children:
            if child.process.poll() is None:
                print(f"pagoda: killing {child.name}", file=sys.stderr)
                child.process.kill()  # a stopped child too: SIGKILL needs no SIGCONT
                child.process.wait()
        if self.own_runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            return
        endpoints = self.server_config.endpoints()
        for endpoint in [*endpoints.api, *self._replica_endpoints()]:
            if endpoint.startswith("ipc://"):  # a process killed mid-way leaves its socket file behind
                Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
        shutil.rmtree(self.runtime_dir / METRICS_DIR, ignore_errors=True)
        (self.runtime_dir / PROCESS_TABLE_FILE).unlink(missing_ok=True)

    def release(self) -> None:
        """Let another launcher use the runtime dir (after shutdown; the process's exit does it too)."""
        self._lock.close()

    def _replica_endpoints(self) -> list[str]:
        out = []
        for replica in range(self.server_config.data_parallel_size):
            config = replace(self.server_config, replica_id=replica)
            out += [config.endpoint(name) for name in ("scheduler", "plan", "result", "stats")]
        return out

    @staticmethod
    def _terminate(children: list[Child]) -> None:
        for child in children:
            if child.process.poll() is None:
                child.process.terminate()
                child.process.send_signal(signal.SIGCONT)  # a stopped child acts on SIGTERM only once continued

    @staticmethod
    def _wait(children: list[Child], deadline: float) -> None:
        for child in children:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _url_host(self) -> str:
        host = self.server_config.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)

    def url(self) -> str:
        return f"http://{self._url_host()}:{self.server_config.port}/v1"


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    try:
        launcher = Launcher(engine_config, server_config)
    except PagodaError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    # Handled synchronously by sigtimedwait in supervise(); blocked so they don't interrupt start-up.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS + [signal.SIGCHLD, signal.SIGHUP])
    code = 1
    try:
        launcher.start()
        launcher.write_process_table()
        print(f"pagoda: starting {engine_config.model} ({len(launcher.children)} processes)...", file=sys.stderr)
        if not launcher.wait_until_healthy():
            if _pending_stop():
                return 0
            print("pagoda: start-up failed", file=sys.stderr)
            return 1
        print(f"pagoda: serving {engine_config.model} at {launcher.url()}", flush=True)
        code = launcher.supervise()
    finally:
        launcher.shutdown()
        launcher.release()
    return code


def _pending_stop() -> bool:
    return bool(set(STOP_SIGNALS) & signal.sigpending())
