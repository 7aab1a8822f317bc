"""The Hydra callback that claims the run (or sweep) folder before Hydra writes into it.

Hydra makes the job's folder and writes ``.hydra/`` (config, overrides) inside ``run_job``,
before ``on_job_start`` fires and before the task function runs; only ``on_run_start`` and
``on_multirun_start`` come earlier (Hydra docs, "Callbacks"). So the claim lives there, and
holds on every path into a run folder: the preflight's (which has claimed already: the claim
nests), ``HYDRA_FULL_ERROR=1`` (which skips the preflight), and an app that calls
``hydra_app`` directly. The folder Hydra will use is then set to the one claimed, as an
absolute path with ``~`` expanded, so a quoted ``~`` never becomes a folder named ``~``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict, read_write

from gradrepro.errors import EXIT_USER_ERROR, UserError
from gradrepro.records.claim import claim, claimed_here, release, runs_below

_claimed: List[Path] = []  # folders this callback claimed, released by ``release_claimed``


def _claim_key(config: Any, key: str, sweep: bool) -> Path:
    HydraConfig.instance().set_config(config)  # run_job does the same before reading the key
    raw = OmegaConf.select(config, key)
    if raw is None or not str(raw).strip():
        raise UserError(f"{key} is empty: it would write into the current folder; name a folder "
                        f"({key}=PATH) or leave the default")
    # As Hydra's run_job names it (os.path.abspath: 'sub/../a' is './a' even where 'sub' does
    # not exist), with '~' expanded, which Hydra leaves to the shell.
    folder = Path(os.path.abspath(os.path.expanduser(str(raw))))
    if sweep and not claimed_here(folder):  # the preflight checked it already where it ran
        found = runs_below(folder)
        if found is not None:
            raise UserError(f"{key}={str(folder)!r} already holds runs ({str(found)!r}): "
                            "choose a new sweep folder")
    claimed = claim(folder, key, markers=()) if sweep else claim(folder, key)
    _claimed.append(claimed)
    node = config.hydra.sweep if sweep else config.hydra.run
    with read_write(node), open_dict(node):
        node.dir = str(claimed)  # Hydra writes exactly where the claim was taken
    return claimed


def _claim_or_exit(config: Any, key: str, sweep: bool) -> None:
    try:
        _claim_key(config, key, sweep)
    except UserError as exc:  # a SystemExit passes through Hydra's error report untouched
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


class ClaimFolder(Callback):
    """Claim ``hydra.run.dir`` (``hydra.sweep.dir`` with -m) before Hydra writes into it."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        _claim_or_exit(config, "hydra.run.dir", sweep=False)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _claim_or_exit(config, "hydra.sweep.dir", sweep=True)


def release_claimed() -> None:
    """Release every folder the callback claimed (the command has ended)."""
    while _claimed:
        release(_claimed.pop())
