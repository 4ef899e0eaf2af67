"""What the process-level tests share: free loopback ports, polling with a deadline, the Prometheus text of
/metrics as numbers, a launcher's service children read from /proc, and `pagoda serve` started until it says
it serves and stopped with SIGTERM (`running_server`). Import it as `tests.harness`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.launcher import free_ports

if TYPE_CHECKING:
    import httpx
    import openai

SERVED = "smollm2-135m-instruct"
_http: httpx.Client | None = None


def http_client() -> httpx.Client:
    """One HTTP client for the helpers (httpx.get/post/stream build a client, TLS context included, per call: 88 ms
    of CPU each at load ~5 here, taken from the server under test), with a new connection per request as before.
    Made on first use, so that importing this module needs no HTTP stack (the GPU device has none)."""
    global _http
    if _http is None:
        import httpx

        _http = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    return _http


def __getattr__(name: str) -> Any:
    """`from tests.harness import HTTP`: the shared client (http_client)."""
    if name == "HTTP":
        return http_client()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def send_all(requests: list[tuple[str, str, dict[str, Any]]], workers: int = 8) -> list[httpx.Response]:
    """(method, url, JSON body) requests sent `workers` at a time on the shared client (the engine batches them),
    their responses in the requests' order: for tables of independent requests checked row by row after."""
    import concurrent.futures

    client = http_client()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda r: client.request(r[0], r[1], json=r[2], timeout=120), requests))


METRIC_RE = re.compile(r"([a-z_]+(?:\{[^}]*\})?) ([-0-9.e+]+|NaN|\+Inf)")


def tiny_llama_over_smollm2_vocab(folder: Path, smollm2_dir: Path) -> Path:
    """A 2-layer Llama of hidden size 64 over SmolLM2's vocabulary saved in `folder` (random weights, seed 0,
    embeddings scaled for sharper distributions than the init's) with SmolLM2's tokenizer files and chat template:
    stop strings, grammars and chat at a fraction of SmolLM2's cost."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


def free_port() -> int:
    return free_ports(1)[0]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll `predicate` until it holds (polling with a deadline: there is nothing to wait on instead); returns
    the seconds it took, fails after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def named_events(data: bytes) -> list[dict[str, Any]]:
    """The `event:` / `data:` pairs of a Responses or Messages stream (no [DONE]: neither API sends one), each
    event's name checked against its type."""
    blocks = data.decode().split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    return events


def parse_metrics(text: str) -> dict[str, float]:
    """Each sample of a Prometheus text page, keyed by its name and labels as written."""
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := METRIC_RE.fullmatch(line))}


def service_children(parent_pid: int, *, live_only: bool = False, env: str | None = None) -> dict[str, list[int]]:
    """The child pids of `parent_pid` that run a pagoda service, by service name (api, tokenizer, scheduler,
    worker), read from /proc; `live_only` leaves out zombies, `env` ("NAME=value") keeps only the children whose
    environment holds that entry."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0") if env is not None else []
        except OSError:
            continue
        ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        state = re.search(r"State:\s+(\w)", status).group(1)  # type: ignore[union-attr]
        match = re.search(r"pagoda\.services\.(\w+)", cmdline)
        if (ppid == parent_pid and match and not (live_only and state == "Z")
                and (env is None or env.encode() in environ)):
            found.setdefault(match.group(1), []).append(int(entry.name))
    return found


@dataclass
class Server:
    process: subprocess.Popen[str]
    port: int
    runtime_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http_client().get(self.url + "/metrics", timeout=10).text)

    def children(self) -> dict[str, list[int]]:
        """Child pids by service name, read from /proc."""
        return service_children(self.process.pid)


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment for a pagoda service process, with one intra-op thread per process: the
    services, the test's client threads and other jobs share a 2-core host, and two torch threads' spin-waits
    on a busy host cost the worker many times the CPU (2026-12-01, load average 4: the structured-output mixed
    batch took 293 s with the default threads, 36 s with one). Correctness does not depend on it."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _resolve_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child of a threaded process only calls


_PRCTL = _resolve_prctl()
_PR_SET_PDEATHSIG = 1
_TEST_PROCESS = os.getpid()


def die_with_parent() -> None:
    """Popen's preexec_fn for a process a test starts: the kernel sends it SIGTERM (a launcher then stops its own
    processes) when the test process dies, even by SIGKILL. Without it a pytest worker killed for memory left its
    server running (2026-12-06: 172 orphaned servers filled the 2-core, 24 GiB host). Runs in the forked child:
    no lookups or allocations beyond the call; a parent that died before it means the child ends at once."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != _TEST_PROCESS:  # the parent died between the fork and the call: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def running_server(model_dir: Path, *extra: str) -> Iterator[Server]:
    port = free_port()
    runtime_dir = Path(f"/tmp/pgt{port}")
    runtime_dir.mkdir(exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--runtime-dir", str(runtime_dir), "--max-model-len", "1024", "--heartbeat-timeout", "3", *extra],
        stdout=subprocess.PIPE, text=True, env=server_env(), preexec_fn=die_with_parent)
    server = Server(process, port, runtime_dir)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the launcher prints one line once every process is healthy
        assert "serving" in line and f":{port}/v1" in line, f"server did not start: {line!r}"
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)


def generate_as_tokenizer(endpoint: str, prompts: list[list[int]], params: object, timeout: float,
                          check_alive: Callable[[], None], identity: str = "test-tokenizer") -> dict[str, list[int]]:
    """Play the tokenizer to a scheduler over ZeroMQ: say hello, send each prompt (request ids "0", "1", ...)
    with `params` (a SamplingParams) once the ModelInfo arrives, answer heartbeats, and collect every request's
    tokens until all have finished. `check_alive` raises if a service process died."""
    import zmq

    from pagoda.shared.messages import (
        AddRequest,
        Heartbeat,
        ModelInfo,
        SchedulerToTokenizer,
        Sequenced,
        TokenDeltas,
        TokenizerHello,
        TokenizerToScheduler,
    )
    from pagoda.shared.transport import Codec, make_socket

    context = zmq.Context()
    sock = make_socket(context, zmq.DEALER, endpoint, bind=False, identity=identity.encode())  # CURVE if keyed
    send, recv = Codec(TokenizerToScheduler), Codec(SchedulerToTokenizer)
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    # this player never acknowledges the scheduler's sequenced frames, so a busy host sees some sent again (the
    # scheduler's resend timer): apply each (stream, seq) once, or its tokens are counted twice
    seen: set[tuple[int, int]] = set()
    try:
        sock.send(send.encode(TokenizerHello(identity, os.getpid())))
        deadline = time.monotonic() + timeout
        while len(finished) < len(prompts):
            assert time.monotonic() < deadline, "the services did not finish in time"
            check_alive()
            if not sock.poll(200):
                continue
            frame = recv.decode(sock.recv())
            if isinstance(frame, Sequenced):
                if (frame.stream, frame.seq) in seen:
                    continue
                seen.add((frame.stream, frame.seq))
            message = opened(recv, frame)
            if isinstance(message, ModelInfo):
                for i, prompt in enumerate(prompts):
                    sock.send(send.encode(AddRequest(request_id=str(i), prompt_token_ids=prompt,
                                                     params=params)))  # type: ignore[arg-type]
            elif isinstance(message, TokenDeltas):
                for request_id, token_id, reason in zip(message.request_ids, message.token_ids,
                                                        message.finish_reasons, strict=True):
                    if token_id >= 0:
                        outputs.setdefault(request_id, []).append(token_id)
                    if reason >= 0:
                        finished.add(request_id)
            elif isinstance(message, Heartbeat):
                sock.send(send.encode(Heartbeat(sender=identity)))
    finally:
        sock.close(0)
        context.term()
    return outputs


def opened(codec: Any, message: Any) -> Any:
    """A Sequenced frame's message, for a test that reads a sequenced stream without playing its receiver
    (shared/delivery.Link): it sees each frame as sent, repeats included."""
    from pagoda.shared.messages import Sequenced

    return codec.decode(message.body) if isinstance(message, Sequenced) else message


class Outbox:
    """Stands in for a socket: keeps what the service sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, payload: Any, flags: int = 0, copy: bool = True) -> None:
        self.sent.append(payload)

    def send_multipart(self, frames: list[Any], flags: int = 0, copy: bool = True) -> None:
        self.sent.append(frames)
