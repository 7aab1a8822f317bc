"""The files of a run folder, and how they are written: atomically (write, then rename).

A killed run never leaves a half file: every write goes to a temporary file in the same
folder and replaces the target with ``os.replace``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np

from gradrepro.errors import UserError

SUMMARY = "summary.json"
SCALARS = "scalars.parquet"
MODULES = "modules.parquet"
FIGURE = "signals.png"


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, then move the finished file onto ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the records from others
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable_path(path: Path, what: str = "output folder") -> None:
    """Raise UserError unless ``path`` is, or can be created as, a writable folder.

    Creates nothing: used before a run starts (preflight), so that an unwritable output
    folder is one line, not a traceback after the data have loaded.
    """
    path = Path(os.path.expanduser(str(path))).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{what}={str(path)!r} cannot be created: {str(existing)!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what}={str(path)!r} is not writable (no write permission on {str(existing)!r})")


def ensure_writable_dir(run_dir: Path) -> None:
    """Create ``run_dir`` and prove a file can be written there, or raise UserError.

    Run before training: a read-only or full disk is reported before any work is done.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-check.") as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise UserError(f"cannot write to the run directory {str(run_dir)!r}: "
                        f"{exc.strerror or exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return str(value)


# JSON has no NaN or Infinity. An infinite value is a value (a ratio over an exact zero,
# signature/numerics.py) and is written as one of these strings; NaN (nothing measured) as null.
# records/reader.py reads both back as floats.
INFINITIES = {"inf": float("inf"), "-inf": float("-inf")}


def _clean(value: Any) -> Any:
    """NaN as null, +-inf as "inf"/"-inf" (the run-directory contract in README.md)."""
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return None if np.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, data: Dict[str, Any]) -> None:
    text = json.dumps(_clean(data), indent=2, default=_json_default, allow_nan=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n"))
