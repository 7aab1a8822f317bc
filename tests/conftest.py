"""Shared test helpers: run the real CLI into a folder the test chooses (STYLE.md, example 8),
and compose configs with Hydra's compose API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


class CliResult:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.run_dir = run_dir

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def scalars(self) -> pd.DataFrame:
        return pd.read_parquet(self.run_dir / "scalars.parquet")

    @property
    def modules(self) -> pd.DataFrame:
        return pd.read_parquet(self.run_dir / "modules.parquet")


def run_cli(run_dir: Path, *overrides: str, timeout: float = 300, env: dict = None) -> CliResult:
    """``python -m gradrepro OVERRIDES hydra.run.dir=RUN_DIR`` in a subprocess."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "gradrepro", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc, Path(run_dir))


def compose_config(overrides: Sequence[str] = ()):
    """The composed config for ``overrides`` (Hydra's compose API, no run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gradrepro.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def experiment_names() -> List[str]:
    folder = CONFIGS / "experiment"
    return sorted(
        str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")
    )


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> Dict[str, Path]:
    """Every experiment at scale=tiny in one multirun of the real CLI (one process: fast),
    as {experiment name: run directory}. Shared by every test that needs a finished run."""
    sweep = tmp_path_factory.mktemp("tiny_sweep")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "gradrepro", "-m", f"experiment={','.join(experiment_names())}",
         "scale=tiny", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for summary in sweep.rglob("summary.json"):
        if "references" in summary.relative_to(sweep).parts:
            continue  # a reference run made by another run
        found[json.loads(summary.read_text())["experiment"]] = summary.parent
    assert sorted(found) == experiment_names()
    return found


def flat_config(cfg) -> Dict[str, object]:
    """A composed config as {dotted key: value}, resolved."""
    from omegaconf import OmegaConf

    def leaves(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return leaves(OmegaConf.to_container(cfg, resolve=True))


@pytest.fixture
def cli(tmp_path):
    """Run the CLI into a fresh folder under tmp_path: ``cli('experiment=x', 'scale=tiny')``."""
    counter = iter(range(1000))

    def _run(*overrides: str, **kwargs) -> CliResult:
        return run_cli(tmp_path / f"run{next(counter)}", *overrides, **kwargs)

    return _run
