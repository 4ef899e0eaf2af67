"""bench/report.py: where a benchmark's JSON report goes (--out, else $OUT/<name>, else a fallback or nowhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench.report import write_report


def test_out_wins_over_the_out_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    path = write_report({"a": 1}, tmp_path / "given" / "x.json", "default.json")
    assert path == tmp_path / "given" / "x.json"
    assert json.loads(path.read_text()) == {"a": 1}
    assert not (tmp_path / "env").exists()


def test_out_variable_names_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    path = write_report([1, 2], None, "bench.json", indent=1)
    assert path == tmp_path / "env" / "bench.json"
    assert path.read_text() == json.dumps([1, 2], indent=1)


def test_nowhere_without_out_unless_a_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    assert write_report({"a": 1}, None, "bench.json") is None
    path = write_report({"a": 1}, None, "bench.json", fallback_dir=str(tmp_path / "fallback"))
    assert path == tmp_path / "fallback" / "bench.json" and path.exists()


def test_a_figure_that_is_no_number_is_written_null(tmp_path: Path) -> None:
    """A serve level whose requests all failed (every percentile of no samples), or one of 1-token outputs (no
    inter-token gaps), wrote NaN into the report: no JSON, and JSON.parse, jq's strict readers or Go refused the
    whole file."""
    from pagoda.bench.report import write_json

    path = write_json(tmp_path / "r.json", {"levels": [{"ttft_p50_ms": float("nan"), "rate": float("inf"),
                                                        "ok": 1.5, "list": [float("-inf"), 2], "t": (float("nan"),)}]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"levels": [{"ttft_p50_ms": None, "rate": None, "ok": 1.5, "list": [None, 2],
                                            "t": [None]}]}
