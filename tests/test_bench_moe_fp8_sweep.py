"""bench/moe_fp8_sweep.py's pieces on the CPU (kernels in Triton's interpreter, a stand-in timer): the experts'
per-row e4m3 form, and a sweep row per token count with both forms timed over the same launches and FP8's error
against the reference small."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.bench import moe_fp8_sweep as sweep
from pagoda.bench.moe_tune import copies_for
from pagoda.shared.shapes import SHAPES


def test_experts_quantized_per_row() -> None:
    w = torch.randn(3, 8, 32) * torch.linspace(0.01, 1.0, 8).view(1, 8, 1)  # rows of very different ranges
    q, scale = sweep.quantize_experts(w)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn and scale.shape == (3, 8, 1)
    torch.testing.assert_close(scale.squeeze(-1), w.abs().amax(dim=-1) / 448.0)
    back = q.float() * scale
    assert ((back - w).abs() <= w.abs().amax(dim=-1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits


def test_sweep_times_both_forms_over_the_same_launches() -> None:
    launches: list[int] = []

    def timer(calls: list[Callable[[], object]]) -> float:
        launches.append(len(calls))
        for call in calls:
            call()
        return 0.01 * len(launches)  # bf16 then fp8: fp8 "slower" at every row

    # fp16 on the CPU: Triton's interpreter computes bf16 wrongly
    rows = sweep.sweep_shape("tiny-moe", (1, 4), torch.device("cpu"), timer, torch.float16)
    spec = SHAPES["tiny-moe"].moe
    assert spec is not None
    hidden, inter = SHAPES["tiny-moe"].hidden_size, spec.expert_intermediate_size
    expected_copies = [copies_for(t, spec.top_k, spec.num_experts, hidden * inter, 50 << 20) for t in (1, 4)]
    assert launches == [n for n in expected_copies for _ in range(2)]  # bf16 and fp8 over the same copies
    assert [row["tokens"] for row in rows] == [1, 4]
    for row in rows:
        assert row["speedup_fp8"] == round(row["bf16_us"] / row["fp8_us"], 3) < 1.0
        assert 0.0 < row["fp8_rel_err"] < 0.1
        assert row["fp8_hbm_fraction"] > 0.0 and row["bf16_hbm_fraction"] > 0.0
