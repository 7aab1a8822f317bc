"""How a run ends, and that its records survive: divergence
is a result, a signal stops a run with its records, SIGKILL leaves no half file, the same
seed gives the same records, and a failing figure or progress bar costs nothing."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, compose_config

from gradrepro.errors import UserError
from gradrepro.probe import Probe
from gradrepro.recipe import build
from gradrepro.records import files as store
from gradrepro.records.writer import Records
from gradrepro.train import pipeline as runner
from gradrepro.train import session

TINY = ("scale=tiny",)
LONG = ("scale=tiny", "train.steps=1000000")  # stopped by the test long before its end


def read_all(run_dir: Path) -> dict:
    """Every record file of a run folder read back (json / pandas); temp files excluded."""
    out = {}
    for path in sorted(run_dir.iterdir()):
        if path.name.startswith("."):  # .hydra/ and atomic-write temp files
            continue
        if path.suffix == ".parquet":
            out[path.name] = pd.read_parquet(path)
        elif path.suffix == ".json":
            out[path.name] = json.loads(path.read_text())
    return out


# --- divergence ---------------------------------------------------------------------------


def test_divergence_is_a_result_with_its_records(cli):
    # A learning rate of 1e30 on the SimSiam control: the loss turns non-finite in a step or two.
    result = cli("experiment=simsiam_baseline", *TINY, "optim.lr=1e30")
    assert result.returncode == 0, result.stderr
    summary = result.summary
    assert summary["status"] == "diverged"
    stopped = summary["stopped_at"]
    assert isinstance(stopped, int) and 0 <= stopped < 6
    assert summary["steps"] == stopped + 1
    scalars, modules = result.scalars, result.modules
    # Everything up to the break is there, and the break itself is recorded as non-finite.
    assert scalars["step"].max() == stopped
    assert not math.isfinite(scalars.set_index("step").loc[stopped, "loss"])
    broken = modules[modules["step"] == stopped]
    assert (broken["grad_state"] == "nonfinite").any()
    assert (broken["frac_nonfinite"] > 0).any()
    assert not math.isfinite(scalars.set_index("step").loc[stopped, "grad_norm"])
    # The verdict is evaluated on what exists: every check is reported, none crashed.
    assert [c["metric"] for c in summary["checks"]] == ["linear_acc", "z_std", "progress_to", "knn_acc"]
    assert summary["reproduced"] is False
    assert (result.run_dir / "signals.png").exists()


def test_total_grad_norm_keeps_non_finite_and_skips_missing_gradients():
    import numpy as np

    from gradrepro.probe.probe import total_grad_norm

    cols = {"grad_state": np.array(["finite", "none", "finite"], dtype=object),
            "grad_norm": np.array([3.0, np.nan, 4.0])}
    assert total_grad_norm(cols) == 5.0
    cols["grad_state"][2], cols["grad_norm"][2] = "nonfinite", np.inf
    assert total_grad_norm(cols) == math.inf


# --- interruption -------------------------------------------------------------------------


def start_run(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "gradrepro", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_records(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> None:
    """Until the run has written its first records (the runner flushes after the first logged step)."""
    deadline = time.monotonic() + timeout
    while not (run_dir / store.MODULES).exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before writing records: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no records within the timeout")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_the_run_and_keeps_readable_records(sig, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *LONG)
    wait_for_records(proc, run_dir)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, err  # the shell's convention: 130 / 143
    assert "Traceback" not in err
    files = read_all(run_dir)
    assert set(files) == {store.SUMMARY, store.SCALARS, store.MODULES}
    summary = files[store.SUMMARY]
    assert summary["status"] == "interrupted"
    assert summary["signal"] == sig.name
    assert summary["stopped_at"] < 1000000 - 1
    assert len(files[store.SCALARS]) >= 1 and len(files[store.MODULES]) >= 1
    assert files[store.SCALARS]["step"].max() <= summary["stopped_at"] + 1


@pytest.mark.slow
def test_a_signal_stops_a_whole_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradrepro", "-m", *LONG, "seed=0,1", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(sweep.rglob(store.MODULES)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    summaries = [json.loads(p.read_text()) for p in sweep.rglob(store.SUMMARY)]
    assert [s["status"] for s in summaries] == ["interrupted"]  # the second job never started
    assert not list(sweep.rglob("seed=1"))


def test_sigkill_leaves_no_half_written_file(tmp_path):
    run_dir = tmp_path / "run"
    # Flush on every logged step, so the kill lands among writes.
    proc = start_run(run_dir, *LONG, "probe.every=1", env={"GRADREPRO_FLUSH_SECONDS": "0"})
    wait_for_records(proc, run_dir)
    time.sleep(1.0)
    proc.kill()
    proc.communicate(timeout=60)
    files = read_all(run_dir)  # every finished file reads back whole
    assert store.SUMMARY not in files, "a killed run has no summary: it is incomplete"
    assert len(files[store.SCALARS]) >= 1 and len(files[store.MODULES]) >= 1
    leftovers = [p.name for p in run_dir.iterdir()
                 if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert all(n.startswith((f".{store.SCALARS}.", f".{store.MODULES}.")) for n in leftovers)


def test_a_signal_in_process_writes_the_summary(tmp_path, monkeypatch):
    """The in-process path (runner.run), with a signal raised from inside the loop."""
    cfg = compose_config([*LONG])
    real_after_step = Probe.finish

    def after_step_then_signal(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_after_step(self, step)

    monkeypatch.setattr(Probe, "finish", after_step_then_signal)
    summary = runner.run(cfg, tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert summary["stopped_at"] == 2
    assert read_all(tmp_path / "run")[store.SUMMARY]["status"] == "interrupted"


# --- determinism --------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", [None, "simsiam_baseline"], ids=["default", "simsiam"])
def test_same_seed_same_records_and_another_seed_differs(experiment, tmp_path):
    overrides = [*TINY] + ([f"experiment={experiment}"] if experiment else [])

    def records(seed: int, name: str):
        run_dir = tmp_path / name
        runner.run(compose_config([*overrides, f"seed={seed}"]), run_dir)
        return run_dir, pd.read_parquet(run_dir / store.SCALARS), pd.read_parquet(run_dir / store.MODULES)

    dir_a, scalars_a, modules_a = records(0, "a")
    dir_b, scalars_b, modules_b = records(0, "b")
    # Bit-identical data (check_exact; NaN positions must agree too).
    pd.testing.assert_frame_equal(scalars_a, scalars_b, check_exact=True)
    pd.testing.assert_frame_equal(modules_a, modules_b, check_exact=True)
    # The files themselves are byte-identical as well (no timestamps in pandas' Parquet).
    for name in (store.SCALARS, store.MODULES):
        assert (dir_a / name).read_bytes() == (dir_b / name).read_bytes()
    if experiment is None:  # one model is enough to show that the seed matters
        _, scalars_c, modules_c = records(1, "c")
        assert not scalars_a.equals(scalars_c)
        assert not modules_a[["grad_norm"]].equals(modules_c[["grad_norm"]])


# --- nothing lost -------------------------------------------------------------------------


def test_a_failing_figure_loses_no_records(tmp_path, monkeypatch, caplog):
    def broken_figure(*args, **kwargs):
        raise RuntimeError("no display, no fonts, no luck")

    monkeypatch.setattr(runner, "plot_signals", broken_figure)
    summary = runner.run(compose_config([*TINY]), tmp_path / "run")
    files = read_all(tmp_path / "run")
    assert summary["status"] == "completed"
    assert files[store.SUMMARY]["status"] == "completed"
    assert files[store.SCALARS]["step"].max() == 6 and len(files[store.MODULES]) > 0
    assert "could not draw" in caplog.text


def test_a_failing_progress_bar_loses_no_records(tmp_path, monkeypatch, caplog):
    class BrokenBar:
        def set_postfix(self, **kwargs):
            raise OSError("the terminal went away")

        update = close = set_postfix

    monkeypatch.setattr(session, "progress", lambda total, desc: BrokenBar())
    summary = runner.run(compose_config([*TINY]), tmp_path / "run")
    assert summary["status"] == "completed"
    assert read_all(tmp_path / "run")[store.SCALARS]["step"].max() == 6
    assert "progress bar switched off" in caplog.text


def test_an_error_mid_run_keeps_the_records_and_says_failed(tmp_path, monkeypatch):
    real_after_step = Probe.finish

    def after_step_that_breaks(self, step):
        if step >= 4:
            raise RuntimeError("a bug at step 4")
        return real_after_step(self, step)

    monkeypatch.setattr(Probe, "finish", after_step_that_breaks)
    with pytest.raises(RuntimeError, match="a bug at step 4"):
        runner.run(compose_config([*TINY]), tmp_path / "run")
    files = read_all(tmp_path / "run")
    summary = files[store.SUMMARY]
    assert summary["status"] == "failed" and summary["stopped_at"] == 4
    assert "a bug at step 4" in summary["error"]
    assert sorted(files[store.MODULES]["step"].unique()) == [0, 2]


def test_an_unwritable_run_folder_is_reported_before_training(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(build, "build_data", lambda *a: pytest.fail("training started"))
    with pytest.raises(UserError, match="cannot write the run folder .*a_file. is a file, not a folder"):
        runner.run(compose_config([*TINY]), blocker / "run")
    with pytest.raises(UserError, match="not a folder"):
        store.check_writable_path(blocker / "run", "hydra.run.dir")


def test_a_failing_periodic_flush_warns_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "0")
    real_flush, calls = Records.flush, {"n": 0}

    def flush_full_disk(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real_flush(self)

    monkeypatch.setattr(Records, "flush", flush_full_disk)
    summary = runner.run(compose_config([*TINY]), tmp_path / "run")
    assert summary["status"] == "completed"
    assert "No space left on device" in caplog.text
    assert read_all(tmp_path / "run")[store.SCALARS]["step"].max() == 6


def test_a_model_that_does_not_fit_the_data_is_one_line_before_training(tmp_path):
    # 2 logits for the 10 digit classes: found by the property test (a traceback at step 0).
    with pytest.raises(UserError, match="labels beyond the model's outputs") as refused:
        runner.run(compose_config([*TINY, "model.num_classes=2"]), tmp_path / "run")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / store.SCALARS).exists()


def test_record_files_are_readable_by_others(tmp_path):
    store.write_json(tmp_path / "x.json", {"a": 1})
    mode = (tmp_path / "x.json").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
