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


def refuse_taken(folder: Path) -> None:
    """UserError, in one line, if ``folder`` already holds a run: what a framework callback checks
    when it is made, before any training."""
    found = existing_run(folder)
    if found is not None:
        raise UserError(f"run folder {str(folder)!r} already holds a run ({found}): choose another "
                        "folder, or move that run away first")


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
    _check_is_folder(key, what)
    try:
        key.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file or a dangling link on the way, a read-only disk
        raise UserError(f"cannot create the {what} {str(key)!r}: {exc.strerror or exc}") from None
    try:
        fd = os.open(key / LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise UserError(f"{what} {str(key)!r} is in use by {_holder(key / LOCK)}: "
                        "choose another folder") from None
    except OSError as exc:
        raise UserError(f"cannot write to the {what} {str(key)!r}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n{socket.gethostname()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    found = existing_run(key, markers)
    below = runs_below(key, skip_self=True) if markers and found is None else None
    if found is not None or below is not None:
        with contextlib.suppress(OSError):
            (key / LOCK).unlink()
        if found is not None:
            raise UserError(f"{what} {str(key)!r} already holds a run ({found}): choose another folder, "
                            "or move that run away first")
        held = ("is a sweep's folder (multirun.yaml): a run written there would hide the sweep's runs"
                if below == key else f"holds other runs ({str(below)!r}): a run written there would hide them")
        raise UserError(f"{what} {str(key)!r} {held} from compare; choose another folder")
    _held[key] = 1
    return key


def _check_is_folder(key: Path, what: str) -> None:
    """A dangling link or a file where the folder should be: one line that says which."""
    if key.is_symlink() and not key.exists():
        raise UserError(f"{what} {str(key)!r} is a symbolic link to {os.readlink(key)!r}, which does "
                        "not exist: remove the link or choose another folder")
    if key.exists() and not key.is_dir():
        raise UserError(f"cannot write the {what} {str(key)!r}: it is a file, not a folder; choose a folder")
    for parent in key.parents:  # a file on the way: 'a/file/run'
        if parent.is_symlink() and not parent.exists():
            raise UserError(f"cannot write the {what} {str(key)!r}: {str(parent)!r} is a symbolic link to "
                            f"{os.readlink(parent)!r}, which does not exist")
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"cannot write the {what} {str(key)!r}: {str(parent)!r} is a file, not a folder")
            break


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


SWEEP_RECORD = "multirun.yaml"  # Hydra's record of a sweep, in the sweep's folder
# How deep a sweep's or a run's runs lie: sweep/job, sweep/job/references/NAME, a subdir pattern.
_RUN_DEPTH = 4


def runs_below(folder: Path, skip_self: bool = False) -> Optional[Path]:
    """A folder at or below ``folder`` (below only, with ``skip_self``) that holds a run or a
    sweep's record (a sweep folder must hold none; a run folder neither). Searched
    ``_RUN_DEPTH`` folders deep, where runs lie, so a large unrelated tree is not walked."""
    root = Path(folder)
    if not root.is_dir():
        return None
    base = len(root.parts)
    for here, dirs, files in os.walk(root):
        depth = len(Path(here).parts) - base
        dirs[:] = sorted(d for d in dirs if d != ".hydra") if depth < _RUN_DEPTH else []
        hydra_record = os.path.isfile(os.path.join(here, HYDRA_RECORD))
        if skip_self and depth == 0:
            if SWEEP_RECORD in files:
                return root
            continue
        if hydra_record or SUMMARY in files or SCALARS in files or SWEEP_RECORD in files:
            return Path(here)
    return None


def refuse_inside_records(output: Path, inputs: Sequence[Path], what: str) -> None:
    """A reader's output (compare's ``--out``, ``--plot``; the report) never lands in what it
    reads nor in any run or sweep folder: UserError if ``output`` (links resolved) is one of
    ``inputs`` or inside one, or inside a folder that holds a run, a lock or a sweep's record."""
    target = Path(os.path.realpath(os.path.expanduser(str(output))))
    for source in inputs:
        read = Path(os.path.realpath(os.path.expanduser(str(source))))
        if target == read or read in target.parents:
            raise UserError(f"{what} {str(output)!r} is inside {str(source)!r}, which this command reads: "
                            "write it somewhere else")
    for folder in target.parents:
        found = existing_run(folder, (*RUN_MARKERS, LOCK, SWEEP_RECORD))
        if found is not None:
            kind = "a sweep's folder" if found == SWEEP_RECORD else "a run folder"
            raise UserError(f"{what} {str(output)!r} is inside {kind} ({str(folder)!r} holds {found}), "
                            "whose records are never overwritten: write it somewhere else")
