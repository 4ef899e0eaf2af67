"""kill -9 and SIGSTOP of each process kind under load, on a fresh server each: clients always get an answer.

Tokenizer and api (restarted, --restart-on-failure): in-flight clients get an error, new requests succeed
again within 30 s. Scheduler and worker: in-flight clients get an error and the server stops, non-zero.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.reliability.harness import Server, StreamOutcome, running_server, stream_completion, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.reliability_full]

FIGURES: dict[str, dict[str, float]] = {}


def _load(server: Server, num: int) -> tuple[list[StreamOutcome], list[threading.Thread]]:
    outcomes: list[StreamOutcome] = []
    body = {"prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True}
    threads = [threading.Thread(target=lambda: outcomes.append(stream_completion(server, body, timeout=120)))
               for _ in range(num)]
    for thread in threads:
        thread.start()
    wait_until(lambda: server.metrics().get("pagoda_num_requests_running", 0) >= 1, 120, "requests to run")
    return outcomes, threads


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill9", "sigstop"])
@pytest.mark.parametrize("kind", ["tokenizer", "api", "scheduler", "worker"])
def test_process_failure_under_load(smollm2_dir: Path, kind: str, sig: signal.Signals) -> None:
    with running_server(smollm2_dir, "--restart-on-failure", "--hang-floor", "4") as server:
        outcomes, threads = _load(server, 3)
        [pid] = server.children()[kind]
        hit_at = time.monotonic()
        os.kill(pid, sig)
        for thread in threads:
            thread.join(120)
        assert len(outcomes) == 3
        # every in-flight client got an answer that is not a success: an error event/status or a closed connection
        assert all(o.error or o.status >= 500 or o.transport_error for o in outcomes), outcomes
        figures = {"inflight_answered_s": round(max(o.ended_at - hit_at for o in outcomes), 2)}
        if kind in ("tokenizer", "api"):
            def serves_again() -> bool:
                pids = server.children().get(kind, [])
                if not pids or pids == [pid]:
                    return False
                outcome = stream_completion(server, {"prompt": "Back?", "max_tokens": 2}, timeout=30)
                return outcome.status == 200 and outcome.done and outcome.error is None  # a whole answer

            wait_until(serves_again, 180, "a restarted process")  # ~30 s quiet; a loaded host is slower
            figures["serving_again_s"] = round(time.monotonic() - hit_at, 2)
            assert server.process.poll() is None
        else:
            server.process.wait(60)
            figures["server_stopped_s"] = round(time.monotonic() - hit_at, 2)
            assert server.process.returncode != 0
        FIGURES[f"{kind}-{sig.name}"] = figures
        print(f"\n{kind} {sig.name}: {figures}")
