"""kv_fp8_bench's timing order: every variant is timed once in the list's order and once in reverse and keeps its
faster time, so the slow first timing of a shape (3-10% on the H200) favours no variant; a variant that fails to
launch is reported and the others still run. The GPU work is replaced by fakes: only the bookkeeping is tested."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.bench import kv_fp8_bench as bench
from pagoda.kernels.paged_attention import AttentionConfig


def _batch() -> bench.Batch:
    k = torch.zeros(4, bench.BLOCK_SIZE, 2, bench.HEAD_DIM)  # [blocks, bs, kvh, D]
    return bench.Batch(q=torch.zeros(2, 4, bench.HEAD_DIM), caches={False: (k, k), True: (k, k)},
                       scales=(torch.ones(1), torch.ones(1)), block_tables=torch.zeros(2, 2, dtype=torch.int32),
                       copy_tables=[], seq_lens=torch.tensor([20, 30]), query_start_loc=torch.tensor([0, 1, 2]),
                       seq_lens_host=[20, 30], query_lens_host=[1, 1])


def test_each_variant_keeps_the_faster_of_a_forward_and_a_reverse_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_time(batch: bench.Batch, variant: bench.Variant, config: AttentionConfig, reps: int) -> float:
        calls.append(variant.name)
        base = {"bf16": 100.0, "fp8_a": 80.0, "fp8_b": 60.0}[variant.name]
        return base * (1.1 if len(calls) == 1 else 1.0) + len(calls) * 0.01  # the very first timing is slow

    def fake_run(batch: bench.Batch, variant: bench.Variant, config: AttentionConfig, copy: int = 0) -> torch.Tensor:
        if variant.name == "fp8_broken":
            raise RuntimeError("out of resources: shared memory")
        return batch.q

    monkeypatch.setattr(bench, "graph_cycle_us", fake_time)
    monkeypatch.setattr(bench, "run_variant", fake_run)
    monkeypatch.setattr(bench, "variant_config", lambda batch, variant: AttentionConfig())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no GPU here: nothing to wait for
    variants = (bench.Variant("bf16", False, {}), bench.Variant("fp8_broken", True, {}),
                bench.Variant("fp8_a", True, {}), bench.Variant("fp8_b", True, {}))
    rows: dict[str, dict[str, Any]] = {r["variant"]: r for r in bench.measure(_batch(), variants, {}, False, 3)}
    assert calls == ["bf16", "fp8_a", "fp8_b", "fp8_b", "fp8_a", "bf16"]  # forward, then reverse
    assert "error" in rows["fp8_broken"] and "us" not in rows["fp8_broken"]
    assert rows["bf16"]["us_passes"][0] > 110.0 and rows["bf16"]["us"] == min(rows["bf16"]["us_passes"]) < 101.0
    assert rows["fp8_b"]["us"] == min(rows["fp8_b"]["us_passes"])
    assert rows["fp8_a"]["speedup_vs_bf16"] == pytest.approx(rows["bf16"]["us"] / rows["fp8_a"]["us"])
