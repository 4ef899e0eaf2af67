"""compose.yaml's services run as plain processes (there is no Docker engine here): each service's rendered
environment and command, as the real Compose CLI renders them, with every compose host name mapped to a free
loopback port. tp2: worker ranks 0 and 1 meet at the TP address and serve a scheduler together. replicas (one
deployment for the module): two apis and two tokenizers as `--scale api=2 --scale tokenizer=2` would start
them, given only the registry's address, find each other and both engine replicas; an api that stops is
forgotten and a new one found; a replica killed with -9 is routed around and rejoins when restarted."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from pagoda.probes import latest_stats
from pagoda.shared.config import env_names
from pagoda.shared.messages import (
    Directory,
    SamplingParams,
    SchedulerStats,
    SchedulerToTokenizer,
    TokenizerHello,
    TokenizerToScheduler,
)
from pagoda.shared.transport import ClusterKeys, Codec, make_socket, use_cluster_keys
from tests.harness import HTTP, die_with_parent, free_port, generate_as_tokenizer, opened, server_env, wait_until

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180.0


def render_profile(profile: str, env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    from test_compose import render  # the Compose CLI wrapper of tests/test_compose.py

    empty = tmp_path / "empty.env"
    empty.write_text("")
    return render(env_file=empty, env={"COMPOSE_PROFILES": profile, **env})["services"]


@dataclass
class Processes:
    """Compose services started as local processes, their tcp://host:port endpoints mapped onto loopback."""

    log_dir: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ClusterKeys.generate(self.log_dir / "keys")  # compose's cluster_key secret; this process's sockets use it too
        use_cluster_keys(ClusterKeys.load(self.log_dir / "keys"))

    def local(self, value: str) -> str:
        def replace(match: re.Match[str]) -> str:
            key = (match.group(1), int(match.group(2)))
            if key not in self.ports:
                self.ports[key] = free_port()
            return f"tcp://127.0.0.1:{self.ports[key]}"

        return re.sub(r"tcp://([\w-]+):(\d+)", replace, value)

    def env(self, service: dict[str, Any], overrides: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in server_env().items() if k not in set(env_names())}  # one intra-op thread each
        env.update({k: self.local(v) for k, v in service["environment"].items() if v})
        assert env["PAGODA_CLUSTER_KEY_DIR"] == "/run/secrets"  # where compose mounts the secret: here, ours
        env["PAGODA_CLUSTER_KEY_DIR"] = str(self.log_dir / "keys")
        env.update(overrides)
        return env

    def start(self, name: str, service: dict[str, Any], overrides: dict[str, str]) -> None:
        """The service's own command, with `python` this interpreter and compose's $$ escapes undone."""
        command = [part.replace("$$", "$") for part in service["command"]]
        if command[0] == "python":
            command[0] = sys.executable
        else:
            assert command[:2] == ["sh", "-c"], command
            command[2] = command[2].replace("exec python ", f"exec {sys.executable} ")
        env = self.env(service, {"HOSTNAME": name, **overrides})
        with (self.log_dir / f"{name}.log").open("wb") as log:
            self.running[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  preexec_fn=die_with_parent)

    def check_alive(self) -> None:
        for name, process in self.running.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with code {process.returncode}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2500:]
                         for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        use_cluster_keys(None)
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        # Cleanup, not a check (SIGTERM handling is tested in test_api, test_server and tests/reliability): 3 s,
        # then kill; with 10 s the tp2 and replicas deployments each spent the whole 10 s here.
        deadline = time.monotonic() + 3
        for process in self.running.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.running.pop(name)
        process.send_signal(sig)
        process.wait(timeout=15)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    running = Processes(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def test_tp2_profile_ranks_meet_and_serve(processes: Processes, tmp_path: Path) -> None:
    """scheduler, worker (rank 0) and worker-rank1 from `--profile tp2`: a step needs both ranks, so greedy
    tokens coming back at all means the ranks formed their group at the profile's TP address."""
    services = render_profile("tp2", {"PAGODA_TENSOR_PARALLEL_SIZE": "2", "PAGODA_DEVICE": "cpu",
                                      "PAGODA_NUM_KV_BLOCKS": "64", "PAGODA_MAX_NUM_BATCHED_TOKENS": "64"}, tmp_path)
    assert {"scheduler", "worker", "worker-rank1"} <= set(services)
    dummy = {"PAGODA_MODEL": "tiny", "PAGODA_LOAD_FORMAT": "dummy"}  # 4 heads, 2 kv heads: they split in 2
    for name in ("scheduler", "worker", "worker-rank1"):
        processes.start(name, services[name], dummy)
    assert ("worker", 29511) in processes.ports  # the TP address was mapped like every other endpoint

    endpoint = processes.local(services["worker"]["environment"]["PAGODA_SCHEDULER_ENDPOINT"])
    prompts = [[3 + i, 40, 41, 42 + i, 7] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        outputs = generate_as_tokenizer(endpoint, prompts, params, STARTUP_TIMEOUT_S, processes.check_alive,
                                        identity="profile-tokenizer")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{processes.logs()}") from None
    assert sorted(outputs) == ["0", "1", "2", "3"] and all(len(t) == 6 for t in outputs.values())
    assert all(0 <= token < 512 for tokens in outputs.values() for token in tokens)


def _directory(registry: str, timeout_s: float = 3.0) -> Directory | None:
    """What the registry tells its tokenizers, as a fresh (and idle) tokenizer hears it."""
    context = zmq.Context()
    try:
        sock = make_socket(context, zmq.DEALER, registry, bind=False,
                           identity=f"observer-{time.monotonic_ns()}".encode())
        sock.send(Codec(TokenizerToScheduler).encode(TokenizerHello("observer", os.getpid())))
        codec = Codec(SchedulerToTokenizer)
        while sock.poll(int(timeout_s * 1000)):
            message = opened(codec, codec.decode(sock.recv()))
            if isinstance(message, Directory):
                return message
        return None
    finally:
        context.destroy(linger=0)


@dataclass
class Deployment:
    processes: Processes
    services: dict[str, Any]
    urls: dict[str, str]  # api instance -> its HTTP url
    registry: str  # the registry's address, as every service is given it

    def stats(self, scheduler: str) -> SchedulerStats | None:
        return latest_stats(self.processes.local(self.services[scheduler]["environment"]["PAGODA_STATS_ENDPOINT"]))

    def start_api(self, name: str) -> None:
        port = free_port()
        self.processes.start(name, self.services["api"], {**TINY, "PAGODA_HOST": "127.0.0.1", "PAGODA_PORT": str(port)})
        self.urls[name] = f"http://127.0.0.1:{port}"

    def healthy(self, name: str, all_replicas: bool = True) -> bool:
        self.processes.check_alive()
        try:
            response = HTTP.get(self.urls[name] + "/health", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and (not all_replicas or "replicas_down" not in response.text)

    def complete(self, api: str, prompt: list[int]) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        return HTTP.post(self.urls[api] + "/v1/completions", json=body, timeout=60).status_code


TINY = {"PAGODA_MODEL": "tiny", "PAGODA_LOAD_FORMAT": "dummy", "PAGODA_NUM_KV_BLOCKS": "256",
        "PAGODA_HEARTBEAT_TIMEOUT": "2"}


def _prompt(system: int, turn: int) -> list[int]:
    """Token ids: a 5-block prefix of its own per system prompt (what prefix routing keys on), then a turn."""
    return [(system * 37 + i * 11) % 500 + 3 for i in range(80)] + [turn % 500 + 3, 7]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`--profile replicas` with `--scale api=2 --scale tokenizer=2`, started in an order where nothing is up
    yet when its peers start (tokenizers first, the registry's scheduler last but one)."""
    tmp_path = tmp_path_factory.mktemp("deployment")
    services = render_profile("replicas", {"PAGODA_DEVICE": "cpu"}, tmp_path)
    assert set(services) == {"scheduler", "replica1-scheduler", "worker", "replica1-worker", "api", "tokenizer"}
    processes = Processes(tmp_path)
    deployed = Deployment(processes, services, {}, processes.local(services["api"]["environment"]
                                                                     ["PAGODA_REGISTRY_ENDPOINT"]))
    try:
        for name in ("tokenizer-a", "tokenizer-b"):
            processes.start(name, services["tokenizer"], TINY)
        deployed.start_api("api-a")
        for name in ("replica1-scheduler", "replica1-worker", "worker", "scheduler"):
            processes.start(name, services[name], TINY)
        deployed.start_api("api-b")
        try:
            wait_until(lambda: all(deployed.healthy(api) for api in ("api-a", "api-b")), STARTUP_TIMEOUT_S,
                       "both apis to see both replicas serving")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{processes.logs()}") from None
        yield deployed
    finally:
        processes.stop()


def test_scaled_apis_and_tokenizers_find_each_other_and_both_replicas(deployment: Deployment) -> None:
    """Given only the registry's address: requests through either api succeed, both tokenizers carry some,
    and prefix routing sends the 8 system prompts to both replicas."""
    work = [(api, _prompt(s, t)) for t in range(2) for s in range(8) for api in ("api-a", "api-b")]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda item: deployment.complete(*item), work))
    assert statuses == [200] * len(work)
    per_tokenizer: dict[str, int] = {}
    served: list[int] = []

    def counted() -> bool:  # the stats lag the requests by up to 0.25 s
        per_tokenizer.clear()
        served.clear()
        for scheduler in ("scheduler", "replica1-scheduler"):
            stats = deployment.stats(scheduler)
            assert stats is not None
            served.append(sum(stats.tokenizer_requests_total))
            for tokenizer_id, count in zip(stats.tokenizer_ids, stats.tokenizer_requests_total, strict=True):
                name = tokenizer_id.rsplit("-", 1)[0]
                per_tokenizer[name] = per_tokenizer.get(name, 0) + count
        return sum(served) == len(work)

    wait_until(counted, 10, "the schedulers' stats to count every request")
    assert min(served) >= 1, served  # both replicas
    assert per_tokenizer.get("tokenizer-a", 0) >= 1 and per_tokenizer.get("tokenizer-b", 0) >= 1, per_tokenizer
    directory = _directory(deployment.registry)
    assert directory is not None and len(directory.apis) == 2
    assert sorted(r.replica_id for r in directory.replicas) == [0, 1]


def test_a_stopped_api_is_forgotten_and_a_new_one_is_found(deployment: Deployment) -> None:
    deployment.processes.kill("api-b", signal.SIGKILL)
    wait_until(lambda: (d := _directory(deployment.registry)) is not None and len(d.apis) == 1, 15,
               "the registry to forget the killed api")
    deployment.start_api("api-c")  # a new container, on an address nobody was told
    wait_until(lambda: deployment.healthy("api-c"), STARTUP_TIMEOUT_S, "the new api to be found by tokenizers")
    assert [deployment.complete("api-c", _prompt(s, 9)) for s in range(4)] == [200] * 4
    assert deployment.complete("api-a", _prompt(0, 9)) == 200


def test_a_killed_replica_is_routed_around_and_rejoins_when_restarted(deployment: Deployment) -> None:
    processes = deployment.processes
    before = deployment.stats("replica1-scheduler")
    assert before is not None
    processes.kill("replica1-scheduler", signal.SIGKILL)
    wait_until(lambda: not deployment.healthy("api-a") and deployment.healthy("api-a", all_replicas=False), 15,
               "/health to name replica 1 as down while replica 0 serves")
    wait_until(lambda: all(deployment.complete("api-a", _prompt(s, 20)) == 200 for s in range(8)), 15,
               "every system prompt to be served by the survivor")
    # compose restarts the container: same address, a new instance; the running worker answers its probe.
    processes.start("replica1-scheduler", deployment.services["replica1-scheduler"], TINY)
    wait_until(lambda: deployment.healthy("api-a"), STARTUP_TIMEOUT_S, "replica 1 to rejoin")
    # /health sees the replica's stats before every tokenizer has said hello to the new scheduler: a request
    # routed there in that gap gets a 503 (seen once in a fresh-clone run), so wait for the whole set to pass.
    wait_until(lambda: all(deployment.complete("api-a", _prompt(s, 30)) == 200 for s in range(8)), 15,
               "every system prompt to be served with both replicas up")
    wait_until(lambda: (s := deployment.stats("replica1-scheduler")) is not None
               and sum(s.tokenizer_requests_total) >= 1, 10, "the restarted replica 1 to be sent requests again")
