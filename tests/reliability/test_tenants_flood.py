"""Two tenants on `pagoda serve` (SmolLM2, CPU): tenant A floods 200 concurrent streams; tenant B's 4 streams keep
their time to first token within 2x of what B gets alone (the scheduler's weighted fair share, not FCFS).

The server runs 8 sequences at once (--max-num-seqs 8): on a CPU a step's time grows with its batch, so without a
cap on the running set no queue order could keep B's TTFT; with it, A's flood waits in the queue and B is served
its share of the slots. Under FCFS B would wait behind A's whole backlog (~190 requests of 16 tokens).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import pytest

from pagoda.services.api.tenants import add_key
from tests.reliability.harness import Server, running_server, wait_until

# A latency ratio on a shared 2-core host: it sat at 1.7-2.02x of its 2x bound in the last runs, so it runs with the
# long reliability tests (make test-reliability), not in make test; tests/test_fairness.py checks the policy itself
# and bench/tenants.py measures the ratio.
pytestmark = [pytest.mark.slow, pytest.mark.reliability_full]

NUM_FLOOD = 200
NUM_B_STREAMS = 4
B_REQUESTS_PER_STREAM = 5
B_MAX_TOKENS = 8
A_MAX_TOKENS = 16
MAX_TTFT_RATIO = 2.0


async def _ttft(client: httpx.AsyncClient, server: Server, key: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first token; the stream is read to its end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    started = time.monotonic()
    first = None
    async with client.stream("POST", server.url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if first is None and event["choices"] and event["choices"][0].get("text"):
                first = time.monotonic() - started
    assert first is not None
    return first


async def _b_streams(client: httpx.AsyncClient, server: Server, key: str, tag: str) -> list[float]:
    async def stream(i: int) -> list[float]:
        return [await _ttft(client, server, key, f"Tenant B {tag} stream {i} request {k}: a story about the sea.",
                            B_MAX_TOKENS) for k in range(B_REQUESTS_PER_STREAM)]

    return [t for ttfts in await asyncio.gather(*(stream(i) for i in range(NUM_B_STREAMS))) for t in ttfts]


async def _flood_worker(client: httpx.AsyncClient, server: Server, key: str, i: int, served: list[int]) -> None:
    """One of A's streams: a request, then the next, until cancelled."""
    k = 0
    while True:
        await _ttft(client, server, key, f"Tenant A flood {i}.{k}: count the waves.", A_MAX_TOKENS)
        served.append(1)
        k += 1


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def _measure(server: Server, key_a: str, key_b: str) -> dict[str, object]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        alone = await _b_streams(client, server, key_b, "alone")
        served: list[int] = []
        flood = [asyncio.create_task(_flood_worker(client, server, key_a, i, served)) for i in range(NUM_FLOOD)]
        try:
            # every flood request tokenized and queued (all but the running ones): B meets the whole flood
            await asyncio.to_thread(wait_until, lambda: _waiting(server, "a") >= NUM_FLOOD - 10, 300,
                                    "tenant A's flood to fill the queue")
            flooded = await _b_streams(client, server, key_b, "flooded")
            waiting_after = _waiting(server, "a")
        finally:
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    return {"b_alone_p99_s": _p99(alone), "b_flooded_p99_s": _p99(flooded),
            "b_alone_median_s": statistics.median(alone), "b_flooded_median_s": statistics.median(flooded),
            "a_served_during": len(served), "a_waiting_at_end": waiting_after,
            "b_alone": [round(t, 3) for t in alone], "b_flooded": [round(t, 3) for t in flooded]}


def _waiting(server: Server, tenant: str) -> float:
    return server.metrics().get(f'pagoda_tenant_sequences_waiting{{tenant="{tenant}"}}', 0.0)


@pytest.mark.timeout(900)
def test_tenant_flood_keeps_the_other_tenants_ttft(smollm2_dir: Path, tmp_path: Path) -> None:
    keys_path = tmp_path / "keys.json"
    _, key_a = add_key(keys_path, "a", {})
    _, key_b = add_key(keys_path, "b", {})
    # --metrics-access open: the test reads the tenants' series itself (beside a keys file they take the operator's
    # key by default, and this server has none)
    with running_server(smollm2_dir, "--api-keys-file", str(keys_path), "--max-num-seqs", "8",
                        "--max-inflight-requests", "4096", "--metrics-access", "open") as server:
        figures = asyncio.run(_measure(server, key_a, key_b))
        ratio = figures["b_flooded_p99_s"] / figures["b_alone_p99_s"]
        print(f"\ntenant flood: {NUM_FLOOD} A streams, {NUM_B_STREAMS}x{B_REQUESTS_PER_STREAM} B requests: "
              f"{ {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()} } "
              f"p99 ratio {ratio:.2f}")
        assert figures["a_waiting_at_end"] >= NUM_FLOOD // 2, "the flood ended before B's measurement did"
        assert ratio <= MAX_TTFT_RATIO, figures
        # the flood's clients left: their requests are aborted and the server is idle and healthy again
        wait_until(lambda: server.metrics().get("pagoda_num_requests_running") == 0
                   and server.metrics().get("pagoda_num_requests_waiting") == 0, 120, "the server to be idle")
        assert server.healthy()
        metrics = server.metrics()
        assert metrics['pagoda_tenant_requests_total{status="200",tenant="b"}'] == 2 * NUM_B_STREAMS * \
            B_REQUESTS_PER_STREAM
        assert metrics['pagoda_tenant_queue_time_seconds_count{tenant="b"}'] >= 2 * NUM_B_STREAMS * \
            B_REQUESTS_PER_STREAM
