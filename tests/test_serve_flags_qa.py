"""`pagoda serve` with bad settings: each is refused in one line naming the setting, exit 2, before any process
starts (no traceback, no process started for a worker or an api to fail later)."""

from __future__ import annotations

import pytest

from pagoda.cli import main
from pagoda.launcher import Launcher


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that gets as far as starting its processes fails the test instead."""
    def start(self: Launcher) -> None:
        raise AssertionError("the launcher started its processes")

    monkeypatch.setattr(Launcher, "start", start)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`pagoda ARGV` exits 2 with one line on stderr, which is returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv", [["serve", "--log-level", "bogus"], ["--log-level", "loud", "chat"],
                                  ["serve", "--log-level", ""]])
def test_a_log_level_logging_does_not_know_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str],
                                                       no_start: None) -> None:
    """`pagoda serve --log-level bogus` was logging's ValueError: Unknown level: 'BOGUS', a traceback."""
    assert "log_level" in _refused([*argv, "--shape", "tiny"], capsys)


def test_a_log_level_from_the_environment_is_checked_too(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, no_start: None) -> None:
    monkeypatch.setenv("PAGODA_LOG_LEVEL", "verbose")
    assert "log_level" in _refused(["serve", "--shape", "tiny"], capsys)


@pytest.mark.parametrize("level", ["DEBUG", "info", "Warning", "error", "critical"])
def test_logging_levels_in_any_case_are_accepted(level: str) -> None:
    from pagoda.shared.config import ServerConfig

    assert ServerConfig(log_level=f" {level}").log_level == level.lower()
