"""No two runs ever write one folder: a default folder name is made unique when the run
starts, a folder is claimed with a lock file before anything is written into it, and a folder
that holds another run (or that another running process holds) is refused in one line. Three
runs started in the same second each keep their own records."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, assert_clean_error, compose_config

from gradrepro import cli
from gradrepro.errors import UserError
from gradrepro.records import claim as claims
from gradrepro.train import pipeline as runner

QUICK = ["scale=tiny", "train.steps=1", "eval.every=0", "probe.every=1"]


def start(cwd: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-m", "gradrepro", *QUICK, *overrides], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_three_runs_started_together_keep_three_folders(tmp_path):
    procs = [start(tmp_path, f"seed={s}") for s in range(3)]  # default folder names: same second
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    assert all(p.returncode == 0 for p, _, _ in results), [err for _, _, err in results]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "results" / "runs").rglob("summary.json")]
    assert sorted(s["seed"] for s in summaries) == [0, 1, 2]
    for path in (tmp_path / "results" / "runs").rglob("summary.json"):  # records and config agree
        config = (path.parent / ".hydra" / "config.yaml").read_text()
        assert f"seed: {json.loads(path.read_text())['seed']}\n" in config
        assert not (path.parent / claims.LOCK).exists()


def test_runs_sharing_a_named_folder_one_runs_the_others_are_refused(tmp_path):
    shared = tmp_path / "shared"
    procs = [start(tmp_path, f"seed={s}", f"hydra.run.dir={shared}") for s in range(3)]
    results = [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=600)]]
    ran = [r for r in results if r[0] == 0]
    refused = [r for r in results if r[0] != 0]
    assert len(ran) == 1 and len(refused) == 2, results
    for code, _, err in refused:
        assert_clean_error(code, err, "hydra.run.dir", str(shared))
    seed = json.loads((shared / "summary.json").read_text())["seed"]
    assert f"seed: {seed}\n" in (shared / ".hydra" / "config.yaml").read_text()


def test_a_folder_that_holds_a_run_is_refused(tmp_path):
    runner.run(compose_config(QUICK), tmp_path / "run")
    before = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(UserError, match="already holds a run"):
        runner.run(compose_config([*QUICK, "seed=1"]), tmp_path / "run")
    assert (tmp_path / "run" / "summary.json").read_bytes() == before


def _claim_fresh(base: str, queue) -> None:
    queue.put(str(claims.claim_fresh(Path(base))))


def test_fresh_names_never_collide_between_processes(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_claim_fresh, args=(str(tmp_path / "run"), queue)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    names = sorted(Path(queue.get(timeout=5)).name for _ in procs)
    assert names == sorted(["run", *(f"run_{i}" for i in range(2, 7))])


def test_a_lock_names_its_holder(tmp_path):
    folder = tmp_path / "run"
    with claims.claimed(folder):
        assert claims.claimed_here(folder)
        with claims.claimed(folder):  # the same process may claim again (a run inside the CLI)
            pass
        assert (folder / claims.LOCK).exists()
    assert not (folder / claims.LOCK).exists()
    # A lock left by a process that no longer runs (kill -9): the folder is refused, and said why.
    (folder / claims.LOCK).write_text(f"{2**22 + 7}\n{os.uname().nodename}\n2026-01-01 00:00:00\n")
    with pytest.raises(UserError, match="stopped without finishing"):
        claims.claim(folder)


def test_a_sweep_folder_that_holds_runs_is_refused(tmp_path):
    (tmp_path / "sweep" / "old" / "seed=0").mkdir(parents=True)
    (tmp_path / "sweep" / "old" / "seed=0" / "summary.json").write_text("{}")
    argv = ["-m", *QUICK, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
