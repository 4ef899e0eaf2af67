"""The measurement switches (PAGODA_* variables for bench/step_ab.py's A/B runs) are read through
pagoda.shared.config.measurement_switch: each use sees the variable as it is now, a value the switch does not take
is a clear error, and every listed switch is read somewhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagoda.shared.config import MEASUREMENT_SWITCHES, ConfigError, measurement_switch

ROOT = Path(__file__).resolve().parent.parent


def test_a_switch_is_read_at_each_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_FUSE_MOE_SUM", raising=False)
    assert measurement_switch("FUSE_MOE_SUM") == ""
    monkeypatch.setenv("PAGODA_FUSE_MOE_SUM", "0")
    assert measurement_switch("FUSE_MOE_SUM") == "0"


@pytest.mark.parametrize(("name", "value"), [("PDL", "off"), ("FUSE_SPLIT_K", "yes"), ("DENSE_GEMV", "2")])
def test_a_value_the_switch_does_not_take_is_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"PAGODA_{name}", value)
    with pytest.raises(ConfigError, match=f"PAGODA_{name} must be one of"):
        measurement_switch(name)


def test_an_unchecked_switch_passes_its_value_to_the_kernel_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_FP8_KV_DECODE", "anything")
    assert MEASUREMENT_SWITCHES["FP8_KV_DECODE"] is None
    assert measurement_switch("FP8_KV_DECODE") == "anything"


def test_every_listed_switch_is_read_and_every_read_is_listed() -> None:
    """measurement_switch("NAME") calls across the package against MEASUREMENT_SWITCHES' keys: a switch that no
    code reads would be documented but do nothing; one read but not listed raises KeyError at its first use."""
    read: set[str] = set()
    for folder in ("kernels", "services", "pagoda", "shared"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "measurement_switch" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    read.add(node.args[0].value)
    assert read == set(MEASUREMENT_SWITCHES)
