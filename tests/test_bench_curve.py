"""bench/curve.py's verdict: medians, spread, paired costs, and no PASS or MISS that the noise could flip."""

from __future__ import annotations

import pytest

from pagoda.bench.curve import summarize


def _runs(plain: list[float], curve: list[float]) -> list[dict[str, object]]:
    """Interleaved as bench/curve.py runs them: plain, curve, curve, plain, plain, curve ..."""
    runs: list[dict[str, object]] = []
    for repeat, (p, c) in enumerate(zip(plain, curve, strict=True)):
        pair = [(False, p), (True, c)] if repeat % 2 == 0 else [(True, c), (False, p)]
        runs += [{"curve": mode, "output_tok_per_s": value} for mode, value in pair]
    return runs


def test_quiet_runs_with_a_small_cost_pass() -> None:
    summary = summarize(_runs([33_000, 33_100, 32_900], [32_600, 32_700, 32_500]))
    assert summary["modes"]["plain"]["median"] == 33_000
    assert summary["modes"]["curve"]["median"] == 32_600
    assert summary["cost"] == pytest.approx(1 - 32_600 / 33_000)
    assert summary["noise"] == pytest.approx(200 / 32_600)
    assert summary["pair_costs"] == pytest.approx([1 - 32_600 / 33_000, 1 - 32_700 / 33_100, 1 - 32_500 / 32_900])
    assert summary["verdict"] == "PASS"


def test_a_cost_far_past_the_noise_misses() -> None:
    summary = summarize(_runs([33_000, 33_050, 32_950], [30_000, 30_050, 29_950]))
    assert summary["verdict"] == "MISS"


def test_a_cost_within_the_noise_is_undecided() -> None:
    # 4% cost, but the modes swing by 10%: the same cost as bench/results/s7 measured once
    summary = summarize(_runs([33_000, 30_000, 34_000], [31_680, 33_000, 29_000]))
    assert summary["cost"] == pytest.approx(0.04)
    assert summary["verdict"] == "UNDECIDED"


def test_one_run_per_mode_decides_nothing() -> None:
    summary = summarize(_runs([33_019], [30_839]))
    assert summary["noise"] == 0.0
    assert summary["verdict"] == "UNDECIDED"
