"""Shared test helpers: run the real CLI into a folder the test chooses (as Hydra's own app
tests do), and compose configs with Hydra's compose API."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "gradrepro" / "configs"


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
    proc = run_module("gradrepro", *overrides, f"hydra.run.dir={run_dir}", timeout=timeout, env=env)
    return CliResult(proc, Path(run_dir))


def compose_config(overrides: Sequence[str] = ()):
    """The composed config for ``overrides`` (Hydra's compose API, no run)."""
    from gradrepro.config.compose import composer

    with composer() as compose:
        return compose(overrides)


@functools.lru_cache(maxsize=None)
def composed(experiment: str, *overrides: str):
    """``experiment``'s composed config, composed once per test session (treat it as read-only)."""
    return compose_config([f"experiment={experiment}", *overrides])


def experiment_names() -> List[str]:
    from gradrepro.config.compose import group_options_recursive

    return group_options_recursive("experiment")


def multirun(sweep_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A ``-m`` sweep into ``sweep_dir``; fails the test with Hydra's stderr if it fails."""
    proc = run_module("gradrepro", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}", timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


SWEEP = ["experiment=simsiam_baseline,simsiam_nostopgrad", "scale=tiny", "threads=1"]
TWO_JOBS = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]  # one run per core of a 2-core machine


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """A folder that ``build(folder)`` fills once per test run. Alone, that is once per session;
    under pytest-xdist (the default run's two workers) every worker's session asks for it, so the
    first one builds it under a lock in the folder the workers share and the others wait for it
    and read it (the pattern of pytest-xdist's docs, "Making session-scoped fixtures execute only
    once")."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent
    folder, done = shared / name, shared / f"{name}.built"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker's failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def joblib_sweep(tmp_path_factory) -> Path:
    """2 experiments x 2 seeds on the joblib launcher, 2 jobs at once (shared by the sweep,
    compare and report tests; treat it as read-only)."""
    return built_once(tmp_path_factory, "joblib", lambda folder: multirun(folder / "sweep", *SWEEP, "seed=0,1",
                                                                       *TWO_JOBS)) / "sweep"


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> Dict[str, Path]:
    """Every experiment at scale=tiny in one multirun of the real CLI, as {experiment name:
    run folder}, on the joblib launcher: two runs at a time with a thread each, one per core
    of a 2-core CI machine (the same verdicts as one process running them in turn). Shared by
    every test that needs a finished run."""
    sweep = built_once(tmp_path_factory, "tiny_sweep", lambda folder: multirun(
        folder, f"experiment={','.join(experiment_names())}", "scale=tiny", "threads=1", *TWO_JOBS, timeout=1800))
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


class InProcessResult(CliResult):
    """What ``gradrepro.train.pipeline.run`` left, read as a CLI run's (returncode 0, stdout)."""

    def __init__(self, run_dir: Path, stdout: str) -> None:
        self.returncode, self.stdout, self.stderr, self.run_dir = 0, stdout, "", Path(run_dir)


@pytest.fixture
def run_in_process(tmp_path):
    """The experiment pipeline in this process (no CLI start-up), into a fresh folder under
    tmp_path: ``run_in_process('experiment=x', 'scale=tiny')``. Tests of the command line
    itself (exit codes, messages, Hydra's folders) use ``cli``."""
    from gradrepro.train.pipeline import run

    counter = iter(range(1000))

    def _run(*overrides: str, **kwargs) -> InProcessResult:
        run_dir = tmp_path / f"run{next(counter)}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run(compose_config(list(overrides)), run_dir, list(overrides))
        return InProcessResult(run_dir, out.getvalue())

    return _run


@pytest.fixture
def cli(tmp_path):
    """Run the CLI into a fresh folder under tmp_path: ``cli('experiment=x', 'scale=tiny')``."""
    counter = iter(range(1000))

    def _run(*overrides: str, **kwargs) -> CliResult:
        return run_cli(tmp_path / f"run{next(counter)}", *overrides, **kwargs)

    return _run


def read_tables(run_dir: Path):
    """(summary, scalars, modules) of a run folder, through gradrepro's one reader."""
    from gradrepro.records import read_run

    run = read_run(Path(run_dir))
    return run.summary, run.scalars(), run.modules()


def probe_step(probe, loss_fn, step: int = 0):
    """One logged step of ``probe`` around ``loss_fn()`` (forward) and its backward; the
    modules.parquet columns it records."""
    with probe.step(step) as p:
        loss_fn().backward()
        p.collect()
    return p.columns


# --- bad input, for every entry point (python -m gradrepro, gradrepro.compare, ...) --------

TRACEBACK_MARKERS = ("Traceback (most recent call last)", "Error executing job",
                     "HYDRA_FULL_ERROR")


def run_module(module: str, *args, timeout: float = 300, env: dict | None = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in a subprocess, with this checkout first on the path."""
    # This checkout first, then whatever the caller's path already held (packages carried
    # beside an image's own, say).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    if env and "HYDRA_FULL_ERROR" in env:
        full_env["HYDRA_FULL_ERROR"] = env["HYDRA_FULL_ERROR"]
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def assert_clean_error(returncode: int, stderr: str, *fragments: str) -> str:
    """Bad input: exit code 2 and exactly one non-empty stderr line that contains every
    fragment (case-insensitive); no traceback. Returns the line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, f"exit code {returncode}, stderr:\n{stderr}"
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert not any(m in stderr for m in TRACEBACK_MARKERS), stderr
    for fragment in fragments:
        assert fragment.lower() in line.lower(), f"{fragment!r} not in {line!r}"
    return line
