"""The four services started one by one as separate processes on tcp:// loopback endpoints, as compose.yaml
runs them (without docker): end-to-end streaming, requests spread over two tokenizers, a tokenizer
killed mid-stream costing only its own requests, and a scheduler killed and started again taking over."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.shared.config import env_names
from pagoda.shared.transport import ClusterKeys
from tests.harness import HTTP, die_with_parent, free_ports, parse_metrics, server_env, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SERVED = "smollm2-135m-instruct"
TOKENIZER_IDS = ("tcp-tokenizer-a", "tcp-tokenizer-b")
STARTUP_TIMEOUT_S = 120.0
HEARTBEAT_TIMEOUT_S = 3.0


@dataclass
class Cluster:
    port: int
    env: dict[str, str]
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    common_flags: list[str] = field(default_factory=list)  # every service's flags (model, heartbeat timeout)
    num_generations: int = 0  # generation requests sent so far: what the scheduler's counts must add up to

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str, service: str, *flags: str) -> None:
        log = (self.log_dir / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", f"pagoda.services.{service}", *flags],
                                                env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                preexec_fn=die_with_parent)
        log.close()  # the child holds its own descriptor

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
                         for path in sorted(self.log_dir.glob("*.log")))

    def check_alive(self, *except_names: str) -> None:
        for name, process in self.processes.items():
            if name not in except_names and process.poll() is not None:
                raise AssertionError(f"{name} exited with code {process.returncode}\n{self.logs()}")

    def health(self) -> int:
        try:
            return HTTP.get(self.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def metrics(self) -> dict[str, float]:
        return parse_metrics(HTTP.get(self.url + "/metrics", timeout=10).text)

    def tokenizer_counts(self) -> dict[str, float]:
        """pagoda_tokenizer_requests_total by tokenizer id (the scheduler's count of requests each sent)."""
        counts = {}
        for key, value in self.metrics().items():
            match = re.fullmatch(r'pagoda_tokenizer_requests_total\{tokenizer="([^"]+)"\}', key)
            if match:
                counts[match.group(1)] = value
        return counts

    def settled_tokenizer_counts(self) -> dict[str, float]:
        """The counts once they include every request sent so far (the stats lag by up to 0.25 s)."""
        wait_until(lambda: sum(self.tokenizer_counts().values()) == self.num_generations, 10,
                   f"the scheduler to count {self.num_generations} requests")
        return self.tokenizer_counts()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        """SIGTERM, api first (it drains), then the rest; SIGKILL whatever is left after the deadline."""
        order = ["api", *(n for n in self.processes if n != "api")]
        for name in order:
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture(scope="module")
def cluster(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    scheduler, plan, result, stats, api, http = free_ports(6)
    # Only this test's settings: no PAGODA_* from the calling shell may leak into the services.
    env = {k: v for k, v in server_env().items() if k not in set(env_names())}  # one intra-op thread each
    env.update({
        "PAGODA_SCHEDULER_ENDPOINT": f"tcp://127.0.0.1:{scheduler}",
        "PAGODA_PLAN_ENDPOINT": f"tcp://127.0.0.1:{plan}",
        "PAGODA_RESULT_ENDPOINT": f"tcp://127.0.0.1:{result}",
        "PAGODA_STATS_ENDPOINT": f"tcp://127.0.0.1:{stats}",
        "PAGODA_API_ENDPOINTS": f"tcp://127.0.0.1:{api}",
        "PAGODA_PORT": str(http),
        "PAGODA_MAX_MODEL_LEN": "1024",
    })
    common = ["--model", str(smollm2_dir), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
    cluster = Cluster(http, env, tmp_path_factory.mktemp("tcp-services"), common_flags=common)
    ClusterKeys.generate(cluster.log_dir / "keys")  # as compose's secret: CURVE on every socket
    env["PAGODA_CLUSTER_KEY_DIR"] = str(cluster.log_dir / "keys")
    try:
        cluster.start("worker", "worker", *common)
        cluster.start("scheduler", "scheduler", *common)
        for tokenizer_id in TOKENIZER_IDS:
            cluster.start(tokenizer_id, "tokenizer", *common, "--tokenizer-id", tokenizer_id)
        cluster.start("api", "api", *common)

        def healthy() -> bool:
            cluster.check_alive()
            return cluster.health() == 200

        try:
            wait_until(healthy, STARTUP_TIMEOUT_S, "the api's /health to answer 200")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{cluster.logs()}") from None
        yield cluster
    finally:
        cluster.stop()


def _chat_stream(cluster: Cluster, content: str, max_tokens: int,
                 on_first_chunk: Callable[[], None] | None = None) -> tuple[str, str | None, int]:
    """Text, finish reason and completion tokens of one streamed chat completion."""
    stream = cluster.client().chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts: list[str] = []
    reason = None
    num_tokens = 0
    for i, chunk in enumerate(stream):
        if i == 0 and on_first_chunk is not None:
            on_first_chunk()
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return "".join(texts), reason, num_tokens


# ------------------------------------------------------------------ (a) end to end


def test_streaming_chat_end_to_end(cluster: Cluster) -> None:
    cluster.num_generations += 1
    text, reason, num_tokens = _chat_stream(cluster, "Name three colours.", 16)
    assert text.strip() and reason == "length" and num_tokens == 16
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [SERVED]


def test_container_healthcheck_script(cluster: Cluster) -> None:
    """docker/healthcheck.py (the image's HEALTHCHECK) against these processes."""

    def check(service: str, **env: str) -> int:
        return subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py"), service],
                              env={**cluster.env, **env}, capture_output=True, timeout=30).returncode

    assert check("api") == 0
    assert check("scheduler") == 0
    assert check("worker") == 0 and check("tokenizer") == 0
    assert check("api", PAGODA_PORT=str(free_ports(1)[0])) == 1  # nothing listens there
    assert check("scheduler", PAGODA_STATS_ENDPOINT=f"tcp://127.0.0.1:{free_ports(1)[0]}") == 1


# ------------------------------------------------------------------ (b) both tokenizers serve


def test_requests_land_on_both_tokenizers(cluster: Cluster) -> None:
    client = cluster.client()
    cluster.num_generations += 6
    # six independent requests sent at once (the engine batches them; the api spreads them over the tokenizers)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda i: client.completions.create(model=SERVED, prompt=f"Count to {i + 3}:",
                                                                      max_tokens=4, temperature=0), range(6)))
    for response in responses:
        assert response.choices[0].finish_reason == "length"
    counts = cluster.settled_tokenizer_counts()
    assert set(counts) == set(TOKENIZER_IDS) and all(n > 0 for n in counts.values()), counts


# ------------------------------------------------------------------ (c) a tokenizer dies mid-stream


@pytest.mark.extended  # tests/reliability (tokenizer kill -9 under load) covers it in the default run
def test_killing_a_tokenizer_fails_only_its_own_requests(cluster: Cluster) -> None:
    victim, survivor = TOKENIZER_IDS
    num_streams = 8
    max_tokens = 96
    before = cluster.settled_tokenizer_counts()
    started = threading.Semaphore(0)

    def one(i: int) -> str:
        try:
            text, reason, num_tokens = _chat_stream(cluster, f"Tell a long story about the number {i}.",
                                                    max_tokens, on_first_chunk=started.release)
        except (openai.APIError, httpx.HTTPError) as exc:
            return f"error: {type(exc).__name__}: {exc}"
        assert reason == "length" and num_tokens == max_tokens and text, (reason, num_tokens)
        return "done"

    cluster.num_generations += num_streams
    with concurrent.futures.ThreadPoolExecutor(num_streams) as pool:
        futures = [pool.submit(one, i) for i in range(num_streams)]
        deadline = time.monotonic() + 60
        for _ in range(num_streams):  # every stream has its first chunk: all are admitted and running
            assert started.acquire(timeout=max(0.0, deadline - time.monotonic())), "streams did not start"

        # Who owns which stream is not visible; how many each tokenizer sent is.
        num_owned_by_victim = int(cluster.settled_tokenizer_counts()[victim] - before[victim])
        cluster.processes[victim].kill()
        cluster.processes.pop(victim).wait(timeout=10)  # gone for good: later checks need not expect it
        outcomes = [f.result(timeout=90) for f in futures]

    errors = [o for o in outcomes if o != "done"]
    # The api spreads requests over the least loaded tokenizers: the victim owned some of these streams.
    assert 0 < num_owned_by_victim < num_streams
    # The survivor's streams all finish; only the victim's may fail (if they had not finished before the kill),
    # each with the error that says why.
    assert len(errors) <= num_owned_by_victim, (num_owned_by_victim, outcomes)
    assert all("tokenizer process serving this request is gone" in e for e in errors), errors
    assert outcomes.count("done") >= num_streams - num_owned_by_victim
    cluster.check_alive(victim)

    # The api dropped the dead tokenizer when it failed its streams; once the scheduler has too, all is well.
    wait_until(lambda: set(cluster.tokenizer_counts()) == {survivor}, 4 * HEARTBEAT_TIMEOUT_S,
               "the scheduler to drop the dead tokenizer")
    assert cluster.health() == 200
    for i in range(3):
        text, reason, num_tokens = _chat_stream(cluster, f"Say hello, take {i}.", 8)
        assert text and reason == "length" and num_tokens == 8
    counts = cluster.tokenizer_counts()
    assert set(counts) == {survivor}


# ------------------------------------------------------------------ (d) the scheduler dies and comes back


def test_a_restarted_scheduler_takes_over(cluster: Cluster) -> None:
    """Kill -9 the scheduler mid-stream and start a new one: the stream ends with an error that says why
    (no hang), the worker and tokenizers register with the newcomer, and requests run again."""
    started = threading.Event()
    outcome: dict[str, str] = {}

    def stream() -> None:
        try:
            _, reason, _ = _chat_stream(cluster, "Tell a very long story about a lighthouse.", 600,
                                        on_first_chunk=started.set)
            outcome["finished"] = str(reason)
        except (openai.APIError, httpx.HTTPError) as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60), "the stream did not start"
    scheduler = cluster.processes["scheduler"]
    scheduler.kill()
    scheduler.wait(timeout=10)
    cluster.start("scheduler", "scheduler", *cluster.common_flags)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the stream hung after its scheduler died"
    assert "scheduler" in outcome.get("error", ""), outcome

    def serves_again() -> bool:
        cluster.check_alive()
        if cluster.health() != 200:
            return False
        try:
            _, reason, num_tokens = _chat_stream(cluster, "Say hello once more.", 8)
        except (openai.APIError, httpx.HTTPError):
            return False  # registration still under way: the api may answer 503 meanwhile
        return reason == "length" and num_tokens == 8

    wait_until(serves_again, 60, "requests to run on the new scheduler")
    cluster.check_alive()


def test_after_an_idle_scheduler_restart_health_means_ready(cluster: Cluster) -> None:
    """The scheduler restarts while the tokenizers are idle: they hold the old one's ModelInfo and have nothing in
    flight to notice the new one by. From the moment the api reads the new scheduler's stats, /health is 200 only
    once a tokenizer registered with it: the first request then is served, not refused."""
    cluster.num_generations += 1
    _chat_stream(cluster, "Say hello.", 4)
    wait_until(lambda: cluster.metrics().get("pagoda_generation_tokens_total", 0) > 0, 10, "stats counting tokens")
    scheduler = cluster.processes["scheduler"]
    scheduler.kill()
    scheduler.wait(timeout=10)
    cluster.start("scheduler", "scheduler", *cluster.common_flags)
    cluster.num_generations = 0  # the new scheduler counts from zero
    # Its counts start at zero: the api reads its stats (and no longer the dead one's, which /health trusts until
    # they are heartbeat_timeout old).
    wait_until(lambda: cluster.metrics().get("pagoda_generation_tokens_total", 1) == 0, 30, "the new scheduler's stats")

    def healthy() -> bool:
        cluster.check_alive()
        return cluster.health() == 200

    wait_until(healthy, 30, "/health to answer 200 again", interval=0.01)
    cluster.num_generations += 1
    text, reason, num_tokens = _chat_stream(cluster, "Say hello again.", 4)
    assert reason == "length" and num_tokens == 4 and text
