"""Load with a KV cache far too small and clients that leave: every request is answered, every block freed."""

from __future__ import annotations

import collections
import concurrent.futures
import random
from pathlib import Path

import pytest

from tests.reliability.harness import running_server, stream_completion, wait_until

NUM_KV_BLOCKS = 6  # 96 tokens for up to 8 sequences of up to ~75 tokens: constant preemption


def _run_load(smollm2_dir: Path, num_requests: int, concurrency: int, lengths: list[int]) -> dict[str, object]:
    rng = random.Random(1)
    plans = [(rng.choice(lengths), rng.random() < 0.2) for _ in range(num_requests)]  # (max_tokens, leave)
    with running_server(smollm2_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8",
                        "--request-timeout", "0") as server:
        rss_before = server.peak_rss_mib()

        def one(i: int) -> str:
            max_tokens, leave = plans[i]
            body = {"prompt": f"Request {i}: write about the sea.", "max_tokens": max_tokens, "ignore_eos": True}
            outcome = stream_completion(server, body, leave_after=2 if leave else None, timeout=600)
            if leave:
                return "left" if outcome.status == 200 and outcome.error is None else f"failed {outcome}"
            ok = outcome.status == 200 and outcome.done and outcome.error is None and outcome.finish_reason == "length"
            return "served" if ok else f"failed {outcome}"

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, range(num_requests)))
        total = server.metrics()["pagoda_kv_blocks_total"] if "pagoda_kv_blocks_total" in server.metrics() else None
        wait_until(lambda: server.metrics().get("pagoda_num_requests_running") == 0
                   and server.metrics().get("pagoda_num_requests_waiting") == 0, 60, "the server to be idle")
        metrics = server.metrics()
        counts = collections.Counter(r.split(" ")[0] for r in results)
        figures = {"requests": num_requests, "concurrency": concurrency, **counts,
                   "preemptions": metrics.get("pagoda_num_preemptions_total"),
                   "kv_blocks_free_after": metrics.get("pagoda_kv_blocks_free"), "kv_blocks_total": total,
                   "peak_rss_mib_before": rss_before, "peak_rss_mib_after": server.peak_rss_mib()}
        print(f"\nload: {figures}")
        failures = [r for r in results if r.startswith("failed")]
        assert not failures, failures[:5]
        assert metrics.get("pagoda_kv_blocks_free") == NUM_KV_BLOCKS  # every block free (or cached) again
        assert server.healthy()
        return figures


@pytest.mark.slow
def test_tiny_kv_cache_load_trimmed(smollm2_dir: Path) -> None:
    _run_load(smollm2_dir, num_requests=12, concurrency=6, lengths=[8, 16, 24])


@pytest.mark.slow
@pytest.mark.reliability_full
def test_tiny_kv_cache_load_full(smollm2_dir: Path) -> None:
    _run_load(smollm2_dir, num_requests=400, concurrency=24, lengths=[8, 24, 48, 64])
