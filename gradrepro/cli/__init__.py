"""The command line: ``python -m gradrepro experiment=NAME [key=value ...]`` (``-m``: a sweep).

Config errors are one line and exit code 2, before Hydra prints its multi-line report: the
preflight (``cli/preflight.py``) composes every combination a sweep names, one value at a
time, and validates it; only a config that composes and validates reaches ``hydra.main``.
``HYDRA_FULL_ERROR=1`` skips the translation and shows Hydra's own report, as Hydra users
expect. Hydra's own flags (``--help``, ``--cfg job``, ``--info``, ...) go to Hydra untouched;
``--config-name``, ``--config-dir`` and ``hydra.searchpath`` are honoured by the preflight too.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gradrepro.cli import preflight
from gradrepro.config.compose import CONFIG_DIR
from gradrepro.config.schema import register_configs
from gradrepro.errors import EXIT_USER_ERROR, UserError
from gradrepro.train.loop import run

# Flags after which Hydra prints something instead of running: these reach Hydra untouched.
_HYDRA_ONLY = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def hydra_app(cfg: DictConfig) -> None:
    """One job: the run, into the folder Hydra made for it."""
    hc = HydraConfig.get()
    try:
        summary = run(cfg, Path(hc.runtime.output_dir), overrides=list(hc.overrides.task))
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if summary["status"] == "interrupted":
        # The shell's convention (128 + signal number): scripts and sweeps stop here too.
        sys.exit(128 + signal.Signals[summary["signal"]].value)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script ``gradrepro`` and ``python -m gradrepro``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        expanded = preflight.expand_globs(argv)
        preflight.check_launcher(expanded)
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if expanded != argv:  # hydra.main reads sys.argv
        argv = sys.argv[1:] = expanded
    args = preflight.parse_argv(argv)
    hydra_only = args is None or any(getattr(args, flag, None) for flag in _HYDRA_ONLY)
    if not hydra_only and not os.environ.get("HYDRA_FULL_ERROR"):
        try:
            preflight.check(argv)
        except UserError as exc:
            print(f"gradrepro: error: {exc}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
    hydra_app()
