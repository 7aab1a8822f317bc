"""Which code made a run (STYLE: the code travels with the numbers): Python, torch and
gradrepro versions and the git commit of the checkout the package was imported from."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Dict, Optional

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
