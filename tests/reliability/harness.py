"""`pagoda serve` with SmolLM2 on CPU as a black box: start it, load it, break its processes, measure."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.harness import HTTP, die_with_parent, free_port, parse_metrics, service_children, wait_until

SERVED = "smollm2-135m-instruct"
API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
START_TIMEOUT_S = 300.0  # the machine is shared: start-up can be slow


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    runtime_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> httpx.Response | None:
        try:
            return HTTP.get(self.url + "/health", timeout=5)
        except httpx.TransportError:
            return None

    def healthy(self) -> bool:
        response = self.health()
        return response is not None and response.status_code == 200

    def metrics(self) -> dict[str, float]:
        return parse_metrics(HTTP.get(self.url + "/metrics", timeout=10).text)

    def children(self) -> dict[str, list[int]]:
        """Live child pids by service name (api, tokenizer, scheduler, worker), read from /proc."""
        return service_children(self.process.pid, live_only=True)

    def peak_rss_mib(self) -> dict[str, float]:
        """VmHWM (peak resident set) of each child, MiB, keyed name[i]."""
        out: dict[str, float] = {}
        for name, pids in sorted(self.children().items()):
            for i, pid in enumerate(sorted(pids)):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                match = re.search(r"VmHWM:\s+(\d+) kB", status)
                if match:
                    out[f"{name}{i}"] = int(match.group(1)) / 1024
        return out

    def post(self, path: str, body: Any = None, *, content: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60.0) -> httpx.Response:
        headers = AUTH if headers is None else headers
        if content is not None:
            return HTTP.post(self.url + path, content=content, headers=headers, timeout=timeout)
        return HTTP.post(self.url + path, json=body, headers=headers, timeout=timeout)


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`pagoda serve` with the key in a file (never on a command line); stopped (SIGTERM) at the end.
    env: PAGODA_* variables for the server (the caller's own are left out)."""
    port = free_port()
    runtime_dir = Path(tempfile.mkdtemp(prefix="pgr", dir="/tmp"))
    key_file = runtime_dir / "key"
    key_file.write_text(API_KEY + "\n")
    log_path = runtime_dir / "serve.log"
    # One intra-op thread per process: on a shared 2-core host two threads' spin-waits cost the worker 10x the
    # CPU (measured 2026-12-01, load average 13: 47.6 s of CPU instead of 4.7 s, 253 s instead of 37 s of wall
    # for the same 8 x 16 tokens), which only slows every test down; liveness is what these tests check.
    env = {"OMP_NUM_THREADS": "1", **{k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")},
           **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model_dir), "--port", str(port),
             "--runtime-dir", str(runtime_dir), "--max-model-len", "1024", "--api-key-file", str(key_file),
             "--heartbeat-timeout", "3", *extra], stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=die_with_parent)
    server = Server(process, port, runtime_dir, log_path)
    try:
        wait_until(lambda: "pagoda: serving" in server.log() or process.poll() is not None, START_TIMEOUT_S,
                   "the server to start", interval=0.2)
        assert process.poll() is None, server.log()[-4000:]
        yield server
    finally:
        for pid in [p for pids in server.children().values() for p in pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # a test may have stopped one
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@dataclass
class StreamOutcome:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # the error event of a stream, or the body of a non-200
    done: bool = False  # [DONE] seen
    ended_at: float = 0.0  # time.monotonic() when the response ended
    transport_error: str | None = None


def stream_completion(server: Server, body: dict[str, Any], *, leave_after: int | None = None,
                      timeout: float = 300.0) -> StreamOutcome:
    """One streamed completion read to the end (or left after `leave_after` events: a disconnect)."""
    import json

    outcome = StreamOutcome()
    try:
        with HTTP.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, headers=AUTH,
                          timeout=timeout) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                response.read()
                outcome.error = response.text
                return outcome
            events = 0
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    outcome.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.error = event["error"]["message"]
                    continue
                for choice in event.get("choices", []):
                    outcome.text += choice.get("text") or ""
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                events += 1
                if leave_after is not None and events >= leave_after:
                    break
    except httpx.HTTPError as exc:
        outcome.transport_error = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended_at = time.monotonic()
    return outcome


@dataclass
class Load:
    """Streams running on threads until stopped; each one's outcome is kept."""

    server: Server
    body: dict[str, Any]
    num_threads: int
    outcomes: list[StreamOutcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.num_threads):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            body = self.body | {"prompt": f"{self.body.get('prompt', 'Count:')} ({i}.{k})"}
            self.outcomes.append(stream_completion(self.server, body))
            k += 1

    def stop(self) -> list[StreamOutcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)
        return self.outcomes


def run_load(server: Server, num_requests: int, concurrency: int, lengths: list[int],
             num_kv_blocks: int) -> dict[str, object]:
    """Streams with random lengths (EOS ignored), a fifth of them left after two events: every request must be
    answered (served to its length, or left without an error), then the server is idle, healthy, and every
    KV block is free again. Returns the figures (printed too)."""
    import collections
    import concurrent.futures
    import random

    rng = random.Random(1)
    plans = [(rng.choice(lengths), rng.random() < 0.2) for _ in range(num_requests)]  # (max_tokens, leave)
    rss_before = server.peak_rss_mib()
    started = time.monotonic()
    done: list[str] = []

    def one(i: int) -> str:
        result = answer(i)
        done.append(result)
        if len(done) % 50 == 0:
            print(f"load: {len(done)} of {num_requests} answered after {time.monotonic() - started:.0f} s", flush=True)
        return result

    def answer(i: int) -> str:
        max_tokens, leave = plans[i]
        body = {"prompt": f"Request {i}: write about the sea.", "max_tokens": max_tokens, "ignore_eos": True}
        outcome = stream_completion(server, body, leave_after=2 if leave else None, timeout=600)
        if leave:
            return "left" if outcome.status == 200 and outcome.error is None else f"failed {outcome}"
        ok = outcome.status == 200 and outcome.done and outcome.error is None and outcome.finish_reason == "length"
        return "served" if ok else f"failed {outcome}"

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(num_requests)))
    elapsed = time.monotonic() - started
    wait_until(lambda: server.metrics().get("pagoda_num_requests_running") == 0
               and server.metrics().get("pagoda_num_requests_waiting") == 0, 60, "the server to be idle")
    metrics = server.metrics()
    counts = collections.Counter(r.split(" ")[0] for r in results)
    figures = {"requests": num_requests, "concurrency": concurrency, **counts, "seconds": round(elapsed, 1),
               "preemptions": metrics.get("pagoda_num_preemptions_total"),
               "kv_blocks_free_after": metrics.get("pagoda_kv_blocks_free"),
               "kv_blocks_total": metrics.get("pagoda_kv_blocks_total"),
               "peak_rss_mib_before": rss_before, "peak_rss_mib_after": server.peak_rss_mib()}
    print(f"\nload: {figures}")
    failures = [r for r in results if r.startswith("failed")]
    assert not failures, failures[:5]
    assert metrics.get("pagoda_kv_blocks_free") == num_kv_blocks  # every block free (or cached) again
    assert server.healthy()
    return figures
