"""The local-shard gradient norm under FSDP2: a distributed run that the command starts itself
(two processes, gloo), its norms against one process's computation, its records against one
process's records, and how it ends when a process is lost or the run is interrupted.

Every run here is the real command line; each test checks that no process of the run is left
and that its scratch folder is gone (the run's temporary folder is the test's, via TMPDIR)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, CliResult, compose_config, multirun, read_tables, run_cli, run_module

from gradrepro.recipe.build import build_training
from gradrepro.train.session import seed_everything

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

TIMEOUT = 600  # seconds: a hang guard for one command (two processes on a loaded 2-core machine)
TINY = ("scale=tiny", "device=cpu")


def processes_of(folder: Path) -> list:
    """Live processes whose command line names a path under ``folder`` (a run's processes are
    started with their spec file in the run's temporary folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if str(folder) in cmdline and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


def assert_nothing_left(tmp: Path) -> None:
    assert processes_of(tmp) == []
    assert list(tmp.glob("gradrepro-ranks-*")) == []  # the scratch folder is removed


def distributed_cli(tmp_path: Path, name: str, *overrides: str, env: dict = None):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    result = run_cli(tmp_path / name, *overrides, timeout=TIMEOUT, env={"TMPDIR": str(tmp), **(env or {})})
    return result, tmp


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Both experiments at scale=tiny in one sweep of the command line (one start-up for both):
    {experiment: its run}, and the temporary folder their processes used."""
    root = tmp_path_factory.mktemp("shard_pair")
    tmp = root / "tmp"
    tmp.mkdir()
    proc = run_module("gradrepro", "-m", "experiment=shard_norm_local,shard_norm_full", *TINY,
                      f"hydra.sweep.dir={root / 'sweep'}", timeout=TIMEOUT, env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {}
    for summary in (root / "sweep").rglob("summary.json"):
        result = CliResult(proc, summary.parent)
        runs[result.summary["experiment"]] = result
    assert sorted(runs) == ["shard_norm_full", "shard_norm_local"]
    return runs, tmp, proc


def test_the_command_starts_two_processes_and_process_0_writes_the_run_folder(pair):
    runs, tmp, proc = pair
    for name, result in runs.items():
        summary = result.summary
        assert summary["status"] == "completed", summary.get("error")
        assert summary["distributed"] == {"processes": 2, "backend": "gloo",
                                          "ranks": {"0": "completed", "1": "completed"}}
        assert {p.name for p in result.run_dir.iterdir()} >= {"summary.json", "scalars.parquet", "modules.parquet"}
        assert proc.stdout.count(f"{name}: signature") == 1  # one verdict each: process 1 prints nothing
    assert (tmp.parent / "sweep" / "comparison.md").exists()  # the sweep's table, as for any sweep
    assert_nothing_left(tmp)


def first_step_gradients() -> dict:
    """One process, the same seed, weights and global batch as the run's step 0: its gradients."""
    cfg = compose_config(["experiment=shard_norm_local", *TINY, "distributed.processes=1"])
    seed_everything(cfg.seed, torch.device("cpu"))
    t = build_training(cfg, torch.device("cpu"))
    batch = t.data.sample(torch.Generator().manual_seed(cfg.seed))
    t.objective(t.net, batch).loss.backward()
    return {name: p.grad.detach() for name, p in t.net.named_parameters()}


def test_the_local_norm_is_process_0s_rows_and_the_full_norm_is_one_process(pair):
    """FSDP2 shards each tensor along its first dimension: process 0 holds the first half of
    its rows. Its clip norm is the norm of those rows of one process's gradients; the full norm
    is the whole gradient's; the clipped gradient, each shard scaled to c, has norm sqrt(2) c."""
    result = pair[0]["shard_norm_local"]
    row = result.scalars.dropna(subset=["clip_norm"]).iloc[0]
    assert row["step"] == 0
    grads = first_step_gradients()
    full = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    shard0 = math.sqrt(sum(float(torch.chunk(g.double(), 2, dim=0)[0].pow(2).sum()) for g in grads.values()))
    assert row["clip_full_norm"] == pytest.approx(full, rel=1e-5)
    assert row["clip_norm"] == pytest.approx(shard0, rel=1e-5)
    assert row["clip_norm"] / row["clip_full_norm"] == pytest.approx(shard0 / full, rel=1e-5)
    c = compose_config(["experiment=shard_norm_local"]).train.grad_clip
    assert shard0 > c and math.sqrt(full**2 - shard0**2) > c  # both processes clip at step 0
    assert row["grad_norm"] == pytest.approx(math.sqrt(2) * c, rel=1e-5)


def test_the_sharded_run_records_what_one_process_records(pair, run_in_process):
    """Full-tensor statistics: the two-process run's per-tensor records are one process's on the
    same global batches (the control: its clip is of the full gradient, the same in both)."""
    two = pair[0]["shard_norm_full"]
    one = run_in_process("experiment=shard_norm_full", *TINY, "distributed.processes=1")
    _, _, two_modules = read_tables(two.run_dir)
    _, _, one_modules = read_tables(one.run_dir)
    for column in ("grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero"):
        np.testing.assert_allclose(two_modules[column], one_modules[column], rtol=1e-4, atol=1e-9, err_msg=column)
    pd.testing.assert_series_equal(two_modules["module"], one_modules["module"])


# Process 0 lost: the run's starting process writes the summary (slow: one more two-process run).
@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_lost_process_ends_the_run_in_one_line_and_a_failed_summary(tmp_path, victim):
    result, tmp = distributed_cli(tmp_path, "run", "experiment=shard_norm_local", *TINY,
                                  env={"GRADREPRO_KILL_RANK_AT": f"{victim}:3"})
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("gradrepro:")]
    assert len(lines) == 1 and f"process {victim} of 2 was lost" in lines[0], result.stderr[-3000:]
    assert "SIGKILL" in lines[0] and "Traceback" not in result.stderr
    summary = result.summary
    assert summary["status"] == "failed" and summary["reproduced"] is None
    assert f"process {victim} of 2 was lost" in summary["error"]
    assert summary["distributed"]["ranks"][str(victim)] == "ended by SIGKILL"
    if victim == 1:  # process 0 noticed at its next collective and wrote its records up to there
        assert "at step 3" in summary["error"] and summary["stopped_at"] == 3
        assert result.modules["step"].max() == 2  # the last logged training step before it (every 2)
    assert_nothing_left(tmp)


def test_an_interrupted_distributed_run_says_so_and_leaves_no_process(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "gradrepro", "experiment=shard_norm_local", *TINY,
                             "train.steps=100000", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "scalars.parquet").exists():  # the first flush: training has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "shard_norm_local: interrupted (SIGTERM); no verdict" in out and "Traceback" not in err
    summary = read_tables(run_dir)[0]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert summary["distributed"]["ranks"]["0"] == "interrupted"
    assert summary["steps"] > 0
    assert_nothing_left(tmp)


@pytest.mark.slow
def test_a_sweep_of_the_distributed_experiment_runs_on_the_joblib_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    proc = multirun(sweep, "experiment=shard_norm_local", "seed=0,1", *TINY, "hydra/launcher=joblib",
                    "hydra.launcher.n_jobs=1", timeout=TIMEOUT)
    assert proc.returncode == 0
    summaries = [read_tables(p.parent)[0] for p in sweep.rglob("summary.json")]
    assert sorted(s["seed"] for s in summaries) == [0, 1]
    assert all(s["status"] == "completed" and s["distributed"]["processes"] == 2 for s in summaries)
    assert (sweep / "comparison.md").exists()


@pytest.mark.slow
def test_processes_whose_starting_process_was_killed_stop_and_write_an_interrupted_summary(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "gradrepro", "experiment=shard_norm_local", *TINY,
                             "train.steps=100000", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "scalars.parquet").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.kill()  # the run's own process, without a chance to end its processes
        proc.wait()
        while processes_of(tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for pid, _ in processes_of(tmp):
            os.kill(pid, signal.SIGKILL)
    assert_nothing_left(tmp)
    summary = read_tables(run_dir)[0]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"


def test_of_processes_noticed_ending_at_one_poll_the_one_killed_by_a_signal_is_named_the_cause():
    from types import SimpleNamespace

    from gradrepro.train.distributed import _cause_first

    def process(rank, code, ended_at):
        return SimpleNamespace(rank=rank, popen=SimpleNamespace(returncode=code), ended_at=ended_at)

    failed_after, killed = process(0, 1, 5.0), process(1, -9, 5.0)
    assert sorted([failed_after, killed], key=_cause_first)[0] is killed
    earlier = process(0, 1, 4.0)  # noticed a poll before: it came first, however it ended
    assert sorted([earlier, killed], key=_cause_first)[0] is earlier
