"""Whatever ends a run, its folder ends with a summary.json whose status says what happened
(or the command says in one line that the records are incomplete, and where): a full disk at
the final write, a signal during reference runs or after the training steps, a second Ctrl-C
while the figure is drawn, a Ctrl-C during start-up, a job failing in the middle of a sweep."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TRACEBACK_MARKERS, compose_config

from gradrepro import cli
from gradrepro.records import files as store
from gradrepro.records.reader import read_run
from gradrepro.train import pipeline as runner
from gradrepro.train.finish import RecordsIncomplete

TINY = ["scale=tiny", "train.steps=4", "probe.every=1", "eval.every=0"]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / store.SUMMARY).read_text())


# --- a full disk at the final write ----------------------------------------------------------


def fill_the_disk_after_training(monkeypatch, refuse) -> None:
    """From the end of the training steps on, a finished write is refused (ENOSPC) when
    ``refuse(file name, bytes written)`` says so; the periodic writes before go through.
    Every write of a run folder ends in ``os.replace`` (write, then rename): refused there."""
    real_replace, real_after = os.replace, runner._after_steps
    full = {"on": False}

    def replace(src, dst, *args, **kwargs):
        if full["on"] and refuse(Path(dst).name, Path(src).read_bytes()):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, *args, **kwargs)

    def after_steps(*args):
        real_after(*args)
        full["on"] = True

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(runner, "_after_steps", after_steps)
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "0")  # a complete earlier write of each file


def test_a_full_disk_keeps_the_earlier_records_and_says_what_is_missing(tmp_path, monkeypatch):
    fill_the_disk_after_training(monkeypatch, lambda name, data: name.endswith(".parquet"))
    summary = runner.run(compose_config(TINY), tmp_path / "run")
    assert summary["status"] == "completed" and summary_of(tmp_path / "run") == summary
    assert [m.split(":")[0] for m in summary["missing"]] == [store.SCALARS, store.MODULES]
    assert all("No space left on device" in m and "holds the steps up to" in m for m in summary["missing"])
    run = read_run(tmp_path / "run")  # the earlier writes are whole, and the run is marked incomplete
    assert not run.complete and "records not all written" in run.status
    assert run.scalars()["step"].max() >= 2 and len(run.modules()) > 0


def test_a_summary_that_does_not_fit_is_written_smaller(tmp_path, monkeypatch):
    # Only a summary without the bulky parts fits: the compact one is written, and says so.
    fill_the_disk_after_training(monkeypatch, lambda name, data: name.endswith(".parquet") or b'"constants":' in data)
    summary = runner.run(compose_config(["experiment=simsiam_nostopgrad", *TINY]), tmp_path / "run")
    written = summary_of(tmp_path / "run")
    assert written["status"] == "completed" and written["experiment"] == "simsiam_nostopgrad"
    assert [c["metric"] for c in written["checks"]] == ["linear_acc", "z_std", "loss", "knn_acc"]
    assert any(m.startswith("summary.json: written compact") for m in written["missing"])
    assert summary == written


def test_real_write_errors_at_the_end_still_leave_a_summary(tmp_path, monkeypatch):
    """The operating system refuses every write over 2 KB (RLIMIT_FSIZE: EFBIG) from the end
    of training on: the record files and the full summary do not fit, a smaller one does."""
    real_after, limits = runner._after_steps, resource.getrlimit(resource.RLIMIT_FSIZE)

    def after_steps(*args):
        real_after(*args)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))

    monkeypatch.setattr(runner, "_after_steps", after_steps)
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "0")
    try:
        summary = runner.run(compose_config(["experiment=simsiam_nostopgrad", *TINY]), tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    written = summary_of(tmp_path / "run")
    assert written == summary and written["status"] == "completed"
    assert any(m.startswith(store.MODULES) for m in written["missing"])
    assert any(m.startswith("summary.json: written") for m in written["missing"])


def test_nothing_writable_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    fill_the_disk_after_training(monkeypatch, lambda name, data: True)
    with pytest.raises(RecordsIncomplete, match="incomplete"):
        runner.run(compose_config(TINY), tmp_path / "direct")
    monkeypatch.setattr(sys, "argv", ["gradrepro", *TINY, f"hydra.run.dir={tmp_path / 'cli'}"])
    with pytest.raises(SystemExit) as stop:
        cli.main(sys.argv[1:])
    err = [line for line in capsys.readouterr().err.splitlines() if "gradrepro" in line]
    assert stop.value.code == 1 and len(err) == 1
    assert str(tmp_path / "cli") in err[0] and "incomplete" in err[0] and "summary.json could not be written" in err[0]


# --- signals after the training steps --------------------------------------------------------


def send_at_reference_step(monkeypatch, sig, step: int = 1) -> dict:
    """Send ``sig`` to this process when a reference run reaches ``step``."""
    from gradrepro.measure import reference_runs
    from gradrepro.probe import Probe

    real_refs, real_after = reference_runs.run_references, Probe.finish
    seen = {"references": 0, "sent": False}

    def run_references(*args, **kwargs):
        seen["references"] += 1
        return real_refs(*args, **kwargs)

    def after_step(self, s):
        if seen["references"] and s == step and not seen["sent"]:
            seen["sent"] = True
            os.kill(os.getpid(), sig)
        return real_after(self, s)

    monkeypatch.setattr(reference_runs, "run_references", run_references)
    monkeypatch.setattr(Probe, "finish", after_step)
    return seen


def test_a_signal_during_a_reference_run_stops_the_run_without_a_verdict(tmp_path, monkeypatch):
    seen = send_at_reference_step(monkeypatch, signal.SIGTERM)
    summary = runner.run(compose_config(["experiment=zero_grad_forgotten", *TINY]), tmp_path / "run")
    assert seen["sent"]
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert summary["reproduced"] is None
    assert summary["references"]["control"]["status"] == "interrupted"
    assert "lookalike" not in summary["references"]  # the next reference never started
    assert not (tmp_path / "run" / "references" / "lookalike").exists()
    assert summary_of(tmp_path / "run" / "references" / "control")["status"] == "interrupted"
    relative = [c for c in summary_of(tmp_path / "run")["checks"] if "closer_to" in (c.get("params") or {})]
    assert relative and all(c["observed"] is None and not c["ok"] for c in relative)


@pytest.mark.parametrize("stage", ["final evaluation", "figure"])
def test_a_signal_after_the_steps_is_honoured(stage, tmp_path, monkeypatch):
    if stage == "figure":
        real = runner.plot_signals

        def plot(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            return real(*args, **kwargs)

        monkeypatch.setattr(runner, "plot_signals", plot)
    else:
        real = runner._after_steps

        def after_steps(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*args)

        monkeypatch.setattr(runner, "_after_steps", after_steps)
    summary = runner.run(compose_config(TINY), tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["reproduced"] is None
    assert summary_of(tmp_path / "run") == summary
    assert read_run(tmp_path / "run").scalars()["step"].max() >= 3  # every step's records kept


def test_a_second_ctrl_c_while_the_figure_is_drawn(tmp_path, monkeypatch, caplog):
    def plot(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the first asks to stop
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the second: now
        raise AssertionError("not reached: the second signal stops the figure")

    monkeypatch.setattr(runner, "plot_signals", plot)
    summary = runner.run(compose_config(TINY), tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"
    assert summary_of(tmp_path / "run")["status"] == "interrupted"
    assert "not drawn: interrupted" in caplog.text


# --- start-up --------------------------------------------------------------------------------


@pytest.mark.parametrize("sig,delay", [(signal.SIGINT, 0.3), (signal.SIGTERM, 0.3), (signal.SIGINT, 4.0)],
                         ids=["SIGINT-imports", "SIGTERM-imports", "SIGINT-later"])
def test_a_signal_during_start_up_is_one_line(sig, delay, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.Popen([sys.executable, "-m", "gradrepro", *TINY, "train.steps=100000",
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig.value, err
    assert not any(m in err for m in TRACEBACK_MARKERS), err
    lines = [line for line in err.splitlines() if line.strip()]
    if not lines:  # the signal came once training had started: the run's own ending, on stdout
        lines = [line for line in out.splitlines() if "interrupted" in line and "no verdict" in line]
    assert len(lines) == 1 and "interrupted" in lines[0], err + out
    if run_dir.exists():  # the folder was made: its summary says what happened
        assert summary_of(run_dir)["status"] == "interrupted"


# --- sweeps ----------------------------------------------------------------------------------


def test_a_failing_job_does_not_abort_the_sweep(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    # batch 1 with BatchNorm: refused only when the run builds (not by the preflight)
    argv = ["-m", "experiment=simsiam_baseline", "data.batch_size=1,32", *TINY, f"hydra.sweep.dir={sweep}"]
    monkeypatch.setattr(sys, "argv", ["gradrepro", *argv])
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and not any(m in err for m in TRACEBACK_MARKERS), err
    statuses = sorted(json.loads(p.read_text())["status"] for p in sweep.rglob(store.SUMMARY))
    assert statuses == ["completed", "failed"]
    assert (sweep / "comparison.md").exists(), err  # the sweep's table is still written
    assert "1 of 2 jobs failed" in err.splitlines()[-1]


def test_a_start_up_signal_that_an_import_swallowed_still_ends_the_run():
    """Python raises KeyboardInterrupt where the signal lands; an import that catches every
    exception can swallow it, and the run then went on as if no signal had come. The handler
    notes each signal it raises, and the start-up reads that note once the imports are done."""
    from gradrepro.errors import RAISED_SIGNALS, interrupt_on_stop_signals

    previous = interrupt_on_stop_signals(sigint=True)
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs in the main thread at the next bytecode
        except BaseException:  # what a swallowing import does
            pass
        assert RAISED_SIGNALS[-1] == signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        RAISED_SIGNALS.clear()
    # The start-up's side: a signal noted but not raised to it ends the run with its one line.
    code = ("import gradrepro.errors as e, runpy; e.RAISED_SIGNALS.append(2); "
            "runpy.run_module('gradrepro', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, *TINY], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["gradrepro: interrupted (SIGINT) while starting; nothing was run or written"], proc.stderr
