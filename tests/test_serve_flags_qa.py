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


@pytest.mark.parametrize("device", ["tpu", "npu", "cuda:x", ""])
def test_a_device_torch_cannot_name_is_refused_before_any_process_starts(
        device: str, capsys: pytest.CaptureFixture[str], no_start: None) -> None:
    """`--device tpu` started every process; the worker died with torch's RuntimeError ('Expected one of cpu, cuda,
    ipu, ...'), a traceback, and the launcher said 'start-up failed'."""
    assert "device" in _refused(["serve", "--shape", "tiny", "--device", device], capsys)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_devices_pagoda_runs_on_are_accepted(device: str) -> None:
    from pagoda.shared.config import EngineConfig

    assert EngineConfig(model="tiny", load_format="dummy", device=device).device == device


def test_cuda_where_torch_sees_no_gpu_is_one_line_naming_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device cuda` on a host without a GPU (or with a CPU-only torch): the worker died with torch's
    AssertionError 'Torch not compiled with CUDA enabled', a traceback; now a ConfigError naming device, which the
    worker process prints as one line."""
    import torch

    from pagoda.services.worker.device import resolve_device
    from pagoda.shared.config import EngineConfig
    from pagoda.shared.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as caught:
        resolve_device(EngineConfig(model="tiny", load_format="dummy", device="cuda"))
    assert caught.value.param == "device" and "--device cpu" in caught.value.message
    assert resolve_device(EngineConfig(model="tiny", load_format="dummy", device="auto")) == "cpu"


def test_a_runtime_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str],
                                                              no_start: None) -> None:
    """`--runtime-dir /etc/passwd` was FileExistsError from the launcher's mkdir, a traceback."""
    path = tmp_path / "a-file"
    path.write_text("x")
    err = _refused(["serve", "--shape", "tiny", "--runtime-dir", str(path)], capsys)
    assert "--runtime-dir" in err and str(path) in err, err
    nested = _refused(["serve", "--shape", "tiny", "--runtime-dir", str(path / "below")], capsys)
    assert "--runtime-dir" in nested, nested


def _launcher(runtime_dir: str) -> Launcher:
    from pagoda.shared.config import EngineConfig, ServerConfig

    return Launcher(EngineConfig(model="tiny", load_format="dummy"), ServerConfig(runtime_dir=runtime_dir))


def test_a_runtime_dir_another_launcher_uses_is_refused(tmp_path, capsys: pytest.CaptureFixture[str],
                                                         no_start: None) -> None:
    """Two `pagoda serve` given one --runtime-dir (PAGODA_RUNTIME_DIR set for both) bound the same ipc:// socket
    paths, and the second's shutdown deleted the first's sockets and its Prometheus folder: the first served on
    with every api series (latencies, pagoda_http_requests_total, vLLM's request series) gone from /metrics. The
    second is now refused while the first runs, and may start once it is gone."""
    first = _launcher(str(tmp_path))
    err = _refused(["serve", "--shape", "tiny", "--runtime-dir", str(tmp_path), "--port", "8349"], capsys)
    assert f"--runtime-dir {tmp_path} is in use" in err and "another pagoda serve" in err, err
    first.release()
    _launcher(str(tmp_path)).release()


def test_metrics_files_a_killed_launcher_left_are_not_counted_by_the_next(tmp_path) -> None:
    """The apis' Prometheus files live in the runtime dir, removed at a clean stop only: after a kill -9, the next
    server on that --runtime-dir summed the dead one's counters and histograms into its own /metrics."""
    stale = tmp_path / "prometheus" / "counter_12345.db"
    stale.parent.mkdir()
    stale.write_bytes(b"\0" * 8)
    launcher = _launcher(str(tmp_path))
    assert not stale.exists()
    launcher.release()


@pytest.mark.parametrize("argv", [
    ["--heartbeat-interval", "nan"], ["--heartbeat-interval", "-1"], ["--heartbeat-interval", "0"],
    ["--heartbeat-timeout", "nan"], ["--heartbeat-timeout", "inf"], ["--shutdown-grace", "-5"],
    ["--shutdown-grace", "nan"], ["--request-timeout", "nan"], ["--body-read-timeout", "inf"],
    ["--step-timeout", "nan"], ["--hang-floor", "nan"], ["--resend-interval", "nan"], ["--resend-interval", "inf"]])
def test_times_that_are_no_finite_number_of_seconds_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str],
                                                                 no_start: None) -> None:
    """--heartbeat-interval nan started every process and the scheduler died with 'cannot convert float NaN to
    integer'; --heartbeat-interval -1 passed (the timeout exceeded it) and the tokenizer heart-beat in a busy loop,
    141,509 'dropped an outgoing message' warnings in 45 s, never healthy, its api killed at the stop. NaN passed
    every `< 0` check (a comparison with NaN is false), so every time setting took it."""
    name = argv[0][2:].replace("-", "_")
    assert name in _refused(["serve", "--shape", "tiny", *argv], capsys)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**23])
def test_a_seed_torch_cannot_take_is_refused_before_any_process_starts(
        seed: int, capsys: pytest.CaptureFixture[str], no_start: None) -> None:
    """`--seed 99999999999999999999999` started every process for the worker to die with torch's 'Overflow when
    unpacking long long', a traceback."""
    assert "seed" in _refused(["serve", "--shape", "tiny", "--seed", str(seed)], capsys)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, -(2**63), 10**13, -(10**13)])
def test_dummy_weights_take_every_seed_torch_does(seed: int) -> None:
    """Each dummy tensor's generator is seeded with seed * 1_000_003 + a name's CRC, which overflowed torch's 64
    bits for seeds past ~9.2e12 (in range for the config): the derived seed now wraps into torch's range, the seeds
    that fitted keep their weights."""
    import zlib

    import torch

    from pagoda.services.worker.weights import DummySource
    from pagoda.shared.config import EngineConfig

    EngineConfig(model="tiny", load_format="dummy", seed=seed)
    torch.manual_seed(seed)  # the worker's own seeding takes it as well
    source = DummySource(seed, torch.device("cpu"), torch.float32)
    assert source("layers.0.mlp.weight", (3, 2), None, 0, 3).shape == (3, 2)
    fitted = DummySource(7, torch.device("cpu"), torch.float32)("w", (4,), None, 0, 4)
    expected = 0.02 * torch.randn((4,), generator=torch.Generator().manual_seed(7 * 1_000_003 + zlib.crc32(b"w")))
    assert torch.equal(fitted, expected)


@pytest.mark.parametrize(("flag", "value"), [
    ("--scheduler-endpoint", "garbage"), ("--registry-endpoint", "garbage"), ("--plan-endpoint", "tcp://host"),
    ("--api-endpoints", "tcp://a:1,garbage"), ("--stats-endpoints", "ipc://"), ("--result-endpoint", "http://a:1")])
def test_an_endpoint_that_is_no_zeromq_address_is_refused_naming_it(flag: str, value: str,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     no_start: None) -> None:
    """`--scheduler-endpoint garbage` started every process for the scheduler to die with ZeroMQ's 'Invalid
    argument (addr='garbage')', a traceback (the registry's the same from the api)."""
    err = _refused(["serve", "--shape", "tiny", flag, value], capsys)
    assert flag[2:].replace("-", "_") in err, err


@pytest.mark.parametrize("value", ["tcp://10.0.0.1:5555", "tcp://scheduler:5555", "tcp://[::1]:5555",
                                   "tcp://*:5555", "ipc:///run/pagoda/scheduler.sock"])
def test_zeromq_addresses_are_accepted(value: str) -> None:
    from pagoda.shared.config import ServerConfig

    assert ServerConfig(scheduler_endpoint=value).scheduler_endpoint == value


@pytest.mark.parametrize(("flag", "path"), [("--usage-log", "missing/usage.jsonl"), ("--usage-log", "."),
                                            ("--responses-store-dir", "a-file")])
def test_a_file_the_api_cannot_open_is_refused_before_any_process_starts(
        flag: str, path: str, tmp_path, capsys: pytest.CaptureFixture[str], no_start: None) -> None:
    """`--usage-log /nonexistent/dir/x.log` started every process for the api to die with 'cannot serve: [Errno 2]
    No such file or directory', naming no flag; `--responses-store-dir` on a file the same ('File exists')."""
    (tmp_path / "a-file").write_text("x")
    extra = ["--responses-store", "4"] if flag == "--responses-store-dir" else []
    err = _refused(["serve", "--shape", "tiny", "--runtime-dir", str(tmp_path / "run"), *extra,
                    flag, str(tmp_path / path)], capsys)
    assert err.startswith(f"pagoda: error: {flag} "), err


@pytest.mark.parametrize(("flag", "value"), [("--generation-config", "/nonexistent"), ("--tokenizer", "/nonexistent"),
                                             ("--generation-config", "."), ("--tokenizer", ".")])
def test_a_folder_the_tokenizers_read_is_checked_before_any_process_starts(
        flag: str, value: str, tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        no_start: None) -> None:
    """`--generation-config /nonexistent` and `--tokenizer /nonexistent` started every process for the tokenizer to
    fail (the latter's line named model, not tokenizer); an empty folder the same."""
    monkeypatch.chdir(tmp_path)  # "." : a folder without the files
    err = _refused(["serve", "--shape", "tiny", flag, value], capsys)
    assert flag[2:].replace("-", "_") in err or flag in err, err


@pytest.mark.parametrize("value", ["garbage", "tcp://host", "127.0.0.1:29500", "http://a:1"])
def test_a_tp_init_address_torch_cannot_meet_at_is_refused(value: str, capsys: pytest.CaptureFixture[str],
                                                           no_start: None) -> None:
    """`-tp 3 --tp-init-address garbage` started every process for each worker rank to die with torch's
    'No rendezvous handler for ://', three tracebacks."""
    assert "tp_init_address" in _refused(["serve", "--shape", "tiny", "--tp-init-address", value], capsys)


@pytest.mark.parametrize("value", ["tcp://worker:29511", "tcp://127.0.0.1:29500", "tcp://[::1]:29500",
                                   "file:///tmp/pagoda-tp", "env://"])
def test_tp_init_addresses_torch_meets_at_are_accepted(value: str) -> None:
    from pagoda.shared.config import EngineConfig

    assert EngineConfig(model="tiny", load_format="dummy", tp_init_address=value).tp_init_address == value
