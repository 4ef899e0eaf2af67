"""The checkout's kernels/ folder, importable as a top-level `kernels` when the checkout's root is on sys.path
(pytest's pythonpath, `python -m` from the root), must not shadow Hugging Face's `kernels` package, which
transformers >= 5.25 installs and imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels(extra_path: Path | None) -> subprocess.CompletedProcess[str]:
    """`import kernels` in a fresh interpreter with the checkout's root first on its path (then extra_path)."""
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = "import kernels, pagoda.kernels.reference; print(kernels.__name__, getattr(kernels, 'MARK', None))"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_an_installed_kernels_package_wins(tmp_path: Path) -> None:
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text("MARK = 'hugging face'\n")
    done = _import_kernels(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kernels", "hugging", "face"]


def test_without_one_the_import_fails_as_if_the_folder_were_not_there() -> None:
    done = _import_kernels(None)
    if "No module named 'kernels'" not in done.stderr:  # an environment with Hugging Face's package installed
        assert done.returncode == 0 and done.stdout.startswith("kernels"), done.stderr
        return
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr
