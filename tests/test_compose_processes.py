"""compose.yaml's profiles run as plain processes (there is no Docker engine here): each service's rendered
environment and command, as the real Compose CLI renders them, with every compose host name mapped to a free
loopback port. tp2: worker ranks 0 and 1 meet at the TP address and serve a scheduler together. replicas: two
engine replicas behind one api, and requests reach both."""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from pagoda.shared.config import env_names
from pagoda.shared.messages import (
    AddRequest,
    Heartbeat,
    ModelInfo,
    SamplingParams,
    SchedulerStats,
    SchedulerToApi,
    SchedulerToTokenizer,
    TokenDeltas,
    TokenizerHello,
    TokenizerToScheduler,
)
from pagoda.shared.transport import Codec

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)  # polling with a deadline
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


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

    def local(self, value: str) -> str:
        def replace(match: re.Match[str]) -> str:
            key = (match.group(1), int(match.group(2)))
            if key not in self.ports:
                self.ports[key] = _free_port()
            return f"tcp://127.0.0.1:{self.ports[key]}"

        return re.sub(r"tcp://([\w-]+):(\d+)", replace, value)

    def env(self, service: dict[str, Any], overrides: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in set(env_names())}
        env.update({k: self.local(v) for k, v in service["environment"].items() if v})
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
            self.running[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        for name, process in self.running.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with code {process.returncode}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2500:]
                         for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 10
        for process in self.running.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


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

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"profile-tokenizer")
    sock.connect(processes.local(services["worker"]["environment"]["PAGODA_SCHEDULER_ENDPOINT"]))
    send, recv = Codec(TokenizerToScheduler), Codec(SchedulerToTokenizer)
    prompts = [[3 + i, 40, 41, 42 + i, 7] for i in range(4)]
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    try:
        sock.send(send.encode(TokenizerHello("profile-tokenizer", os.getpid())))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(finished) < len(prompts):
            assert time.monotonic() < deadline, f"no answer in time\n{processes.logs()}"
            processes.check_alive()
            if not sock.poll(200):
                continue
            message = recv.decode(sock.recv())
            if isinstance(message, ModelInfo):
                params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
                for i, prompt in enumerate(prompts):
                    sock.send(send.encode(AddRequest(request_id=str(i), prompt_token_ids=prompt, params=params)))
            elif isinstance(message, TokenDeltas):
                for request_id, token_id, reason in zip(message.request_ids, message.token_ids,
                                                        message.finish_reasons, strict=True):
                    if token_id >= 0:
                        outputs.setdefault(request_id, []).append(token_id)
                    if reason >= 0:
                        finished.add(request_id)
            elif isinstance(message, Heartbeat):
                sock.send(send.encode(Heartbeat(sender="profile-tokenizer")))
    finally:
        sock.close(0)
        context.term()
    assert sorted(outputs) == ["0", "1", "2", "3"] and all(len(t) == 6 for t in outputs.values())
    assert all(0 <= token < 512 for tokens in outputs.values() for token in tokens)


def _latest_stats(endpoint: str, timeout_s: float = 3.0) -> SchedulerStats | None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        codec = Codec(SchedulerToApi)
        while sock.poll(int(timeout_s * 1000)):
            stats = codec.decode(sock.recv())
            if isinstance(stats, SchedulerStats):
                return stats
        return None
    finally:
        context.destroy(linger=0)


def test_replicas_profile_serves_from_both_replicas(processes: Processes, smollm2_dir: Path, tmp_path: Path) -> None:
    services = render_profile("replicas", {"PAGODA_DEVICE": "cpu", "PAGODA_MAX_MODEL_LEN": "512",
                                           "PAGODA_KV_CACHE_MEMORY": "128MiB"}, tmp_path)
    names = ["scheduler", "replica1-scheduler", "worker", "replica1-worker", "api", "tokenizer",
             "replica1-tokenizer"]
    assert set(names) == set(services)
    http_port = _free_port()
    for name in names:  # one tokenizer per pool (compose would start PAGODA_TOKENIZER_REPLICAS of each)
        processes.start(name, services[name], {"PAGODA_MODEL": str(smollm2_dir), "PAGODA_HOST": "127.0.0.1",
                                               "PAGODA_PORT": str(http_port)})
    stats_endpoints = [processes.local(services[n]["environment"]["PAGODA_STATS_ENDPOINT"])
                       for n in ("scheduler", "replica1-scheduler")]
    assert stats_endpoints[0] != stats_endpoints[1]
    url = f"http://127.0.0.1:{http_port}"

    def ready() -> bool:
        processes.check_alive()
        try:
            healthy = httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
        replica1 = _latest_stats(stats_endpoints[1], 1.0)
        return healthy and replica1 is not None and replica1.worker_ready and len(replica1.tokenizer_ids) == 1

    try:
        wait_until(ready, STARTUP_TIMEOUT_S, "both replicas to be ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{processes.logs()}") from None

    def complete(i: int) -> int:
        body = {"model": "smollm2-135m-instruct", "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent: the api spreads them over tokenizers
        statuses = list(pool.map(complete, range(12)))
    assert statuses == [200] * 12
    served: list[int] = []

    def counted() -> bool:  # the stats lag the requests by up to 0.25 s
        served[:] = [sum(stats.tokenizer_requests_total) if (stats := _latest_stats(e)) else 0
                     for e in stats_endpoints]
        return sum(served) == 12

    wait_until(counted, 10, "both schedulers' stats to count the 12 requests")
    assert min(served) >= 1, served  # each replica served some of them
