"""Reading files of a run folder as untrusted data: only regular files are opened (a FIFO
would block, a link to ``/dev/zero`` would never end), sizes are bounded before anything is
parsed, JSON nesting and YAML aliases are bounded, and no interpolation is ever evaluated
(YAML is read as plain data, ``${...}`` stays text). Every refusal is a ``ValueError`` whose
message is one line."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import IO, Any, Optional

import yaml

# A run's summary.json is a few KB (one entry per check and per recorded constant; the init
# reference of a 100-tensor model adds ~20 KB). Far above any real one, far below memory.
MAX_JSON_BYTES = 16 << 20
# Hydra's .hydra/config.yaml of a run is a few KB; its overrides.yaml less.
MAX_YAML_BYTES = 4 << 20
# Hydra writes no YAML aliases; an alias-expanded document over this many nodes is a bomb
# (a composed gradrepro config has well under 1,000 nodes).
MAX_YAML_NODES = 100_000
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def one_line(text: Any, limit: int = 400) -> str:
    """``text`` as one printable line (a warning line must stay one line, whatever a file says)."""
    flat = " ".join(str(text).split())
    flat = "".join(c if c.isprintable() else "?" for c in flat)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def file_kind(mode: int) -> str:
    for test, name in _FILE_KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path) -> IO[bytes]:
    """Open ``path`` for reading only if it is (or links to) a regular file. O_NONBLOCK: opening
    a FIFO returns at once instead of waiting for a writer; the kind is then read from the
    open descriptor, so the file cannot be swapped between the check and the read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{Path(path).name} is {file_kind(mode)}, not a regular file: not opened")
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{Path(path).name} is larger than {limit} bytes: not read")
    return data


def _bounded_int(text: str) -> Any:
    # int() of a 4000-digit literal is slow and no field of a summary needs more than 64 bits:
    # a longer one becomes a float (infinite when huge), which the schema then refuses.
    return int(text) if len(text.lstrip("-")) <= 19 else float(text)


def _no_constant(name: str) -> Any:
    return math.nan if name == "NaN" else (math.inf if name == "Infinity" else -math.inf)


def load_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file as untrusted data (``ValueError`` with the reason otherwise)."""
    raw = read_bounded(path, limit)
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{Path(path).name} is nested too deeply to be a gradrepro record") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{Path(path).name} is unreadable ({type(exc).__name__}: {one_line(exc)})") from None


def _expanded_size(node: yaml.Node, memo: dict, limit: int) -> int:
    """Nodes in the document once every alias is expanded (shared nodes counted each time they
    are referenced), computed on the node graph without expanding it."""
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise ValueError("a YAML alias refers to itself")
        return memo[key]
    memo[key] = None
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total += _expanded_size(child, memo, limit)
        if total > limit:
            break
    memo[key] = total
    return total


def load_yaml(path: Path, limit: int = MAX_YAML_BYTES, max_nodes: int = MAX_YAML_NODES) -> Any:
    """Plain data from a YAML file, never resolved: ``${...}`` interpolations stay strings."""
    text = read_bounded(path, limit)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and _expanded_size(root, {}, max_nodes) > max_nodes:
            raise ValueError(f"{Path(path).name} expands to more than {max_nodes} YAML nodes "
                             "(aliases): not a Hydra record")
        return yaml.load(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ValueError(f"{Path(path).name} is nested too deeply") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{Path(path).name} is not valid YAML ({one_line(exc, 160)})") from None


def parquet_budget() -> Optional[int]:
    """Bytes a record table may take once read: half the machine's memory (reading more would
    end the process instead of the one run), None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return None
