"""One run, one folder: a run (or a sweep) claims its folder before it writes anything there.

The claim is a lock file created with ``O_CREAT | O_EXCL`` (atomic on local file systems:
of several processes, exactly one creates it), naming the process that holds it. A folder
already locked by another process, or already holding a run's records, is refused with one
line; a folder without an explicit name gets a fresh one (``NAME``, ``NAME_2``, ...), so runs
started in the same second never share one. The lock is removed when the run ends; one left
behind names a process that was killed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence

from gradrepro.errors import UserError
from gradrepro.records.files import MODULES, SCALARS, SUMMARY, check_path_length

LOCK = ".gradrepro.lock"
HYDRA_RECORD = str(Path(".hydra") / "config.yaml")
# What shows that a folder already holds a run: its records, or Hydra's record of its job.
RUN_MARKERS = (SUMMARY, SCALARS, MODULES, HYDRA_RECORD)
_MAX_SUFFIX = 10_000

_held: Dict[Path, int] = {}  # folders this process holds, with how many claims are nested


def _key(folder: Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(folder))))


def claimed_here(folder: Path) -> bool:
    """Whether this process holds ``folder``."""
    return _key(folder) in _held


def _holder(lock: Path) -> str:
    """Who holds ``lock``, in words, and whether that process still runs."""
    try:
        pid_text, host, started = (lock.read_text().split("\n") + ["", "", ""])[:3]
        pid = int(pid_text)
    except (OSError, ValueError):
        return "another run (its lock file is unreadable)"
    since = f", started {started}" if started else ""
    if host != socket.gethostname():
        return f"a run on {host} (pid {pid}{since})"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"a run that was stopped without finishing (pid {pid}{since}; its records are kept)"
    except OSError:
        pass
    return f"another running process (pid {pid}{since})"


def existing_run(folder: Path, markers: Sequence[str] = RUN_MARKERS) -> Optional[str]:
    """The first of ``markers`` that ``folder`` holds, or None."""
    for marker in markers:
        path = Path(folder) / marker
        if path.exists() or path.is_symlink():
            return marker
    return None


def claim(folder: Path, what: str = "run folder", markers: Sequence[str] = RUN_MARKERS,
          exclusive: bool = False) -> Path:
    """Claim ``folder`` for this process (nested claims by the same process are allowed unless
    ``exclusive``: two recorders in one process); UserError if another process (or, where
    ``exclusive``, anything) holds it or it already holds one of ``markers``."""
    key = _key(folder)
    check_path_length(key, what)
    if key in _held and exclusive:
        raise UserError(f"{what} {str(key)!r} is in use by this process (another recording or run "
                        "writes there): choose another folder")
    if key in _held:
        _held[key] += 1
        return key
    try:
        key.mkdir(parents=True, exist_ok=True)
        fd = os.open(key / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise UserError(f"{what} {str(key)!r} is in use by {_holder(key / LOCK)}: "
                        "choose another folder") from None
    except OSError as exc:
        raise UserError(f"cannot write to the {what} {str(key)!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n{socket.gethostname()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    found = existing_run(key, markers)
    if found is not None:
        with contextlib.suppress(OSError):
            (key / LOCK).unlink()
        raise UserError(f"{what} {str(key)!r} already holds a run ({found}): choose another folder, "
                        "or move that run away first")
    _held[key] = 1
    return key


def claim_fresh(folder: Path, what: str = "run folder") -> Path:
    """Claim a folder that did not exist: ``folder``, else ``folder_2``, ``folder_3``, ...
    (``mkdir`` without ``exist_ok`` is atomic: two processes never get the same one)."""
    base = _key(folder)
    check_path_length(base, what)
    for i in range(1, _MAX_SUFFIX):
        candidate = base if i == 1 else base.with_name(f"{base.name}_{i}")
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"cannot create the {what} {str(candidate)!r}: {exc.strerror or exc}") from None
        return claim(candidate, what)
    raise UserError(f"{what}: {_MAX_SUFFIX} folders named {str(base)!r}_N exist already: choose another name")


def release(folder: Path) -> None:
    """End one claim of ``folder``; the last one removes the lock."""
    key = _key(folder)
    if key not in _held:
        return
    _held[key] -= 1
    if _held[key] == 0:
        del _held[key]
        with contextlib.suppress(OSError):
            (key / LOCK).unlink()


@contextlib.contextmanager
def claimed(folder: Path, what: str = "run folder", markers: Sequence[str] = RUN_MARKERS) -> Iterator[Path]:
    """``claim`` for the block, ``release`` after it."""
    key = claim(folder, what, markers)
    try:
        yield key
    finally:
        release(key)


def runs_below(folder: Path) -> Optional[Path]:
    """A folder at or below ``folder`` that holds a run (a sweep folder must hold none)."""
    root = Path(folder)
    if not root.is_dir():
        return None
    for marker in (SUMMARY, SCALARS, "config.yaml"):
        for hit in root.rglob(marker):
            if hit.name != "config.yaml" or hit.parent.name == ".hydra":
                return hit.parent.parent if hit.name == "config.yaml" else hit.parent
    return None
