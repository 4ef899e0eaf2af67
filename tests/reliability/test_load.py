"""The full load test: 400 requests, 24 concurrent, a KV cache of 6 blocks for up to 8 sequences of up to ~75
tokens (constant preemption), a fifth of the clients leaving mid-stream: every request is answered and every
block is free afterwards. `make test-reliability` runs it; the default run has a trimmed one in test_hostile.py
(on that module's server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.harness import run_load, running_server

NUM_KV_BLOCKS = 6  # 96 tokens


@pytest.mark.slow
@pytest.mark.reliability_full
@pytest.mark.timeout(3600)  # ~15k tokens on a shared 2-core CPU
def test_tiny_kv_cache_load_full(smollm2_dir: Path) -> None:
    with running_server(smollm2_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8",
                        "--request-timeout", "0") as server:
        run_load(server, num_requests=400, concurrency=24, lengths=[8, 24, 48, 64], num_kv_blocks=NUM_KV_BLOCKS)
