"""``python -m gradrepro experiment=NAME [key=value ...]``: one run (or ``-m``, a sweep)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gradrepro import cli
from gradrepro.config import register_configs
from gradrepro.errors import EXIT_USER_ERROR, UserError

register_configs()


@hydra.main(version_base="1.3", config_path=str(cli.CONFIG_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from gradrepro.runner import run

    hc = HydraConfig.get()
    try:
        summary = run(cfg, Path(hc.runtime.output_dir), overrides=list(hc.overrides.task))
    except UserError as exc:
        print(f"gradrepro: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    if summary["status"] == "interrupted":
        # The shell's convention (128 + signal number): scripts and sweeps stop here too.
        sys.exit(128 + signal.Signals[summary["signal"]].value)


def main() -> None:
    cli.main(hydra_main)


if __name__ == "__main__":
    main()
