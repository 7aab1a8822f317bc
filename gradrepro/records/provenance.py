"""Which code made a run (STYLE: the code travels with the numbers): Python, torch and
gradrepro versions and the git commit of the checkout the package was imported from."""

from __future__ import annotations

import hashlib
import platform
import subprocess
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

import gradrepro


def versions() -> Dict[str, Optional[str]]:
    commit = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(gradrepro.__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradrepro": gradrepro.__version__,
        "git_commit": commit,
    }


# What a verdict is judged by: the experiments' configs (knobs, thresholds, roles, references)
# and the signature code that evaluates them. A table of verdicts names the hash of both, so a
# table made by other configs or other signature code can be told from a current one.
JUDGED_BY = ("configs", "signature")


def source_hash(parts: Sequence[str] = JUDGED_BY) -> str:
    """sha256 (first 16 hex digits) of the package's ``parts`` folders: every .yaml and .py file
    by its path inside the package and its bytes, in sorted order (no git needed)."""
    root = Path(gradrepro.__file__).resolve().parent
    digest = hashlib.sha256()
    for part in parts:
        for path in sorted((root / part).rglob("*")):
            if path.is_file() and path.suffix in (".yaml", ".py"):
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
