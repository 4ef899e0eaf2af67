"""bench/step_ab.py's variant parsing and one batch's measurement (a tiny model on the CPU, a counting timer)."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench.step_ab import measure, parse_variant


def test_variants_parse_with_commas_in_values() -> None:
    assert parse_variant("on=PAGODA_L2=attn,gu:8;PAGODA_PDL=force") == (
        "on", {"PAGODA_L2": "attn,gu:8", "PAGODA_PDL": "force"})
    assert parse_variant("base=") == ("base", {})
    for bad in ("novalue", "=X=1", "x=FLAG"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_measure_times_each_variant_and_compares_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.services.worker.models import CausalLM
    from pagoda.services.worker.weights import load_model
    from pagoda.shared.shapes import SHAPES

    model = CausalLM(SHAPES["tiny"], torch.float32, torch.device("cpu"), max_positions=64)
    load_model(model, None, "dummy", seed=0)
    monkeypatch.setenv("STEP_AB_PROBE", "x")
    timed: list[str] = []

    def timer(step: object) -> float:
        timed.append(__import__("os").environ["STEP_AB_PROBE"])
        return float(len(timed))

    with torch.inference_mode():
        line = measure(model, 2, 20, [("a", {"STEP_AB_PROBE": "a"}), ("b", {"STEP_AB_PROBE": "b"})], 2, False, timer)
    assert timed == ["a", "b", "a", "b"]  # each variant's settings in force while it is timed, every round
    assert "B=2 ctx 20: a 1.000  b 2.000" in line and "differ from a: none" in line
