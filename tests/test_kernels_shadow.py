"""The checkout's kernels/ folder, importable as a top-level `kernels` when the checkout's root is on sys.path
(pytest's pythonpath, `python -m` from the root), must not shadow Hugging Face's `kernels` package, which
transformers >= 5.25 installs and imports."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_without_one_the_folder_is_an_empty_stand_in() -> None:
    """No Hugging Face package: `import kernels` gives a module with no file, version, submodules or names, which
    transformers' availability check reads as not installed (transformers 5.24 imports it to look for a version;
    an ImportError raised there broke importing transformers' models, DeepSeek's parity oracle among them)."""
    code = ("import kernels\n"
            "assert kernels.__file__ is None and kernels.__path__ == [] and not hasattr(kernels, '__version__')\n"
            "try:\n    from kernels import Device\nexcept ImportError:\n    print('absent')\n"
            "import pagoda.kernels.reference\n")
    elsewhere = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    if importlib.machinery.PathFinder.find_spec("kernels", elsewhere) is not None:
        pytest.skip("Hugging Face's kernels package is installed here: the handoff above applies")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["absent"], done.stderr
