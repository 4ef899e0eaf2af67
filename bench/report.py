"""Where a benchmark's JSON report goes: the file named by --out, else <default name> under $OUT when OUT is set."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def stamp() -> str:
    """The local date and time a report carries, e.g. '2026-12-02 06:30:00 UTC'."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def write_json(path: str | Path, data: Any, indent: int = 2) -> Path:
    """`data` as JSON in `path`, its folder made when missing. A figure that is no number (NaN or infinite: a
    percentile of no samples, a rate over no time) is written null: JSON has no NaN, and strict readers (JSON.parse,
    Go, serde) refuse the file that Python's default writes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(data), indent=indent, allow_nan=False))
    return path


def finite(data: Any) -> Any:
    """`data` with every float that is NaN or infinite replaced by None, through dicts, lists and tuples."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [finite(value) for value in data]
    return data


def unwritable(path: str | Path) -> str | None:
    """Why a report could not be written at `path`, or None when it can: its folder is made and the file opened for
    appending (a file this creates is removed again). A benchmark asks before it runs, so that a long run does not
    end in a traceback that loses its figures."""
    path = Path(path)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        return f"{exc.strerror or exc}: {exc.filename or path}"
    return None


def report_path(out: str | Path | None, default_name: str, fallback_dir: str | None = None) -> Path | None:
    """--out when given, else $OUT/default_name, else fallback_dir/default_name; None: no report wanted."""
    if out:
        return Path(out)
    folder = os.environ.get("OUT") or fallback_dir
    return Path(folder) / default_name if folder else None


def write_report(data: Any, out: str | Path | None, default_name: str, *, indent: int = 2,
                 fallback_dir: str | None = None, announce: bool = False) -> Path | None:
    """Write `data` where report_path says (printing 'wrote PATH' when `announce`); the path, or None if nowhere."""
    path = report_path(out, default_name, fallback_dir)
    if path is None:
        return None
    write_json(path, data, indent)
    if announce:
        print(f"wrote {path}")
    return path
