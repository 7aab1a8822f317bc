"""The files of a run folder, and how they are written: atomically (write, then rename).

A killed run never leaves a half file: every write goes to a temporary file in the same
folder and replaces the target with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict

import numpy as np

from gradrepro.errors import UserError
from gradrepro.records.untrusted import file_kind

SUMMARY = "summary.json"
SCALARS = "scalars.parquet"
MODULES = "modules.parquet"
FIGURE = "signals.png"


def _tmp_prefix(path: Path) -> str:
    # The writer's host and pid are in the name, so a later write can tell a temporary left by
    # a killed process (removed) from one another process is writing now (left alone).
    return f".{path.name}.{socket.gethostname()}-{os.getpid()}."


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the atomic-write temporaries (``.NAME.HOST-PID.*.tmp``) in ``folder`` that a
    process of this host, no longer running, left behind (``kill -9`` between write and
    rename). Called before every write, so the next write into a folder cleans it."""
    tag = f".{socket.gethostname()}-"
    try:
        leftovers = [p for p in Path(folder).glob(".*.tmp") if tag in p.name]
    except OSError:
        return
    for tmp in leftovers:
        pid = tmp.name.rsplit(tag, 1)[1].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, then move the finished file onto ``path``."""
    path = Path(path)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the records from others
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# POSIX's minimums where the file system does not say (NAME_MAX 255 bytes, PATH_MAX 4096 on Linux).
_NAME_MAX, _PATH_MAX = 255, 4096


def _limit(path: Path, name: str, default: int) -> int:
    existing = path
    while existing != existing.parent:
        try:
            if existing.is_dir():
                break
        except OSError:
            pass
        existing = existing.parent
    try:
        return int(os.pathconf(existing, name))
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows), or no limit
        return default


def check_path_length(path: Path, what: str) -> None:
    """A path the file system cannot even name (a component over NAME_MAX bytes, the whole over
    PATH_MAX) is a UserError of one line, before any ``stat`` raises ENAMETOOLONG."""
    path = Path(os.path.expanduser(str(path))).absolute()
    name_max = _limit(path, "PC_NAME_MAX", _NAME_MAX)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise UserError(f"{what}: the name {part[:24] + '...'!r} is {size} bytes long; this file system "
                            f"allows {name_max} per folder or file name: choose a shorter one")
    path_max = _limit(path, "PC_PATH_MAX", _PATH_MAX)
    if len(os.fsencode(str(path))) >= path_max:
        raise UserError(f"{what}: the path is {len(os.fsencode(str(path)))} bytes long; this file system "
                        f"allows fewer than {path_max}: choose a shorter one")


def check_output_file(path: Path, what: str) -> Path:
    """The file an output option (``--out``, ``--plot``) may write: a new file, or an existing
    regular, writable one (a link to one: the file it names). A folder, a device, a FIFO or a
    read-only file is refused with a UserError; so is a folder that cannot hold the file.
    Returns the path to write (links resolved)."""
    path = Path(os.path.expanduser(str(path)))
    check_path_length(path, what)
    if path.is_symlink() or path.exists():
        try:
            info = path.stat()
        except OSError as exc:
            raise UserError(f"{what} {str(path)!r} cannot be written: {exc.strerror or exc}") from None
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{what} {str(path)!r} is {file_kind(info.st_mode)}, not a regular file: "
                            "choose a file name")
        if not info.st_mode & 0o222 or not os.access(path, os.W_OK):
            raise UserError(f"{what} {str(path)!r} is read-only: choose another file or make it writable")
        path = path.resolve()
    check_writable_path(path.parent, f"the folder of {what}")
    return path


def write_output(path: Path, write: Callable[[str], None], what: str) -> None:
    """``atomic_write`` for a user-named output: any OS error (a read-only or full disk) is
    one UserError line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)
    except OSError as exc:
        raise UserError(f"could not write {what} {str(path)!r}: {exc.strerror or exc}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable_path(path: Path, what: str = "output folder") -> None:
    """Raise UserError unless ``path`` is, or can be created as, a writable folder.

    Creates nothing: used before a run starts (preflight), so that an unwritable output
    folder is one line, not a traceback after the data have loaded.
    """
    check_path_length(path, what)
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
        raise UserError(f"cannot write to the run folder {str(run_dir)!r}: "
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
# gradrepro/numerics.py) and is written as one of these strings; NaN (nothing measured) as null.
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
