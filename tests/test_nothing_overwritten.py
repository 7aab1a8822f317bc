"""Nothing a run wrote is lost or changed by a later command: readers (compare, report) never
write into a run or sweep folder nor over what they read; a folder that holds runs is never a
run folder; a file or a dangling link where a folder should be is said as such. Every refusal
is one line and a non-zero exit, and the run folders hash the same before and after."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import assert_clean_error, compose_config, run_module
from omegaconf import OmegaConf

import gradrepro
from gradrepro.analysis import compare as compare_cli
from gradrepro.analysis import report as report_cli
from gradrepro.errors import UserError
from gradrepro.records import claim as claims
from gradrepro.train import pipeline as runner

TINY = ["experiment=simsiam_nostopgrad", "scale=tiny", "train.steps=2", "eval.every=0", "probe.every=1"]


def tree_hash(folder: Path) -> str:
    """One hash of every file's path and bytes below ``folder`` (links not followed)."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder as Hydra leaves it: multirun.yaml and two finished jobs with .hydra/."""
    root = tmp_path_factory.mktemp("records") / "sweep"
    root.mkdir()
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for seed in (0, 1):
        overrides = [*TINY, f"seed={seed}"]
        cfg = compose_config(overrides)
        job = root / f"seed={seed}"
        runner.run(cfg, job, overrides)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    return root


def compare_line(capsys, *args) -> str:
    code = compare_cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    return assert_clean_error(code, err)


@pytest.mark.parametrize("option,name", [("--out", "summary.json"), ("--out", "scalars.parquet"),
                                         ("--plot", "signals.png"), ("--out", "new.md"),
                                         ("--out", ".hydra/config.yaml")])
def test_compare_never_writes_into_the_run_it_reads(sweep, option, name, capsys):
    run = sweep / "seed=0"
    before = tree_hash(sweep)
    extra = ["--format", "csv"] if name.endswith((".json", ".parquet")) else []
    line = compare_line(capsys, run, option, run / name, *extra)
    assert option in line and "reads" in line
    assert tree_hash(sweep) == before


def test_compare_never_writes_into_another_run_or_a_sweep(sweep, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(sweep / "seed=1", other)
    before = tree_hash(sweep), tree_hash(other)
    assert "run folder" in compare_line(capsys, sweep / "seed=0", "--out", other / "cmp.md")
    assert "run folder" in compare_line(capsys, sweep / "seed=0", "--plot", other / "sub" / "cmp.png")
    assert "sweep" in compare_line(capsys, other, "--out", sweep / "cmp.md")
    # through a link to the run: real paths are compared
    (tmp_path / "link").symlink_to(sweep / "seed=0")
    assert compare_line(capsys, other, "--out", tmp_path / "link" / "summary.json", "--format", "csv")
    # a csv's second table goes beside --out: the folder it lands in is checked the same way
    assert (tree_hash(sweep), tree_hash(other)) == before
    assert compare_cli.main([str(other), "--out", str(tmp_path / "cmp.md")]) == 0


def test_report_never_writes_into_the_sweep_it_reads_or_a_run(sweep, capsys):
    before = tree_hash(sweep)
    for out in (sweep, sweep / "report", sweep / "seed=0"):
        code = report_cli.main(["--from-sweep", str(sweep), "--out", str(out)])
        assert_clean_error(code, capsys.readouterr().err, "--out")
    assert tree_hash(sweep) == before


def test_a_folder_that_holds_runs_is_never_a_run_folder(sweep, tmp_path):
    before = tree_hash(sweep)
    with pytest.raises(UserError, match=r"is a sweep's folder \(multirun.yaml\)"):
        runner.run(compose_config(TINY), sweep, TINY)
    parent = tmp_path / "runs"
    shutil.copytree(sweep / "seed=0", parent / "2026-01-01" / "old")  # a folder of runs, no multirun.yaml
    with pytest.raises(UserError, match="holds other runs"):
        claims.claim(parent)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="holds other runs"):
        gradrepro.record(model, torch.optim.SGD(model.parameters(), lr=0.1), parent)
    assert tree_hash(sweep) == before
    assert not (parent / claims.LOCK).exists() and not (sweep / claims.LOCK).exists()


def test_a_run_into_a_sweep_folder_is_one_line_from_the_command_line(sweep):
    before = tree_hash(sweep)
    proc = run_module("gradrepro", *TINY, f"hydra.run.dir={sweep}", timeout=120)
    assert_clean_error(proc.returncode, proc.stderr, "sweep's folder", str(sweep))
    assert tree_hash(sweep) == before


def test_a_file_or_a_dangling_link_is_named_as_such(tmp_path):
    (tmp_path / "file").write_text("mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = {tmp_path / "file": "is a file, not a folder", tmp_path / "file" / "run": "is a file, not a folder",
             tmp_path / "dangling": "symbolic link", tmp_path / "dangling" / "run": "symbolic link"}
    for path, said in cases.items():
        with pytest.raises(UserError, match=said) as refused:
            gradrepro.record(model, optimizer, path)
        assert "in use" not in str(refused.value) and "lock" not in str(refused.value)
        with pytest.raises(UserError, match=said):
            claims.claim(path, "hydra.run.dir")
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "nowhere").exists()


def test_an_unknown_plot_metric_is_one_line_naming_the_recorded_ones(sweep, tmp_path, capsys):
    line = compare_line(capsys, sweep, "--plot", tmp_path / "cmp.png", "--metric", "grad_nrom")
    assert "grad_nrom" in line and "grad_norm" in line and "grad_to_param" in line
    assert not (tmp_path / "cmp.png").exists()
    assert compare_cli.main([str(sweep), "--plot", str(tmp_path / "cmp.png"), "--metric", "grad_to_param"]) == 0


def test_a_summary_that_claims_another_experiment_is_skipped_with_one_warning(sweep, tmp_path, capsys):
    edited = tmp_path / "edited"
    shutil.copytree(sweep / "seed=0", edited)
    summary = json.loads((edited / "summary.json").read_text())
    (edited / "summary.json").write_text(json.dumps({**summary, "experiment": "simsiam_baseline"}))
    code = compare_cli.main([str(edited), str(sweep / "seed=1"), "--table", "runs", "--format", "csv"])
    captured = capsys.readouterr()
    assert code == 0
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "simsiam_baseline" in warnings[0] and "simsiam_nostopgrad" in warnings[0]
    assert list(pd.read_csv(io.StringIO(captured.out))["experiment"]) == ["simsiam_nostopgrad"]


class _FullDisk:
    """A log file's stream on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        pass


def test_a_full_disk_mid_run_is_one_line_not_logging_tracebacks(tmp_path, monkeypatch, capsys):
    """The log file and the records' last writes on a full disk: the run's own one-line ending,
    and not logging's "--- Logging error ---" with a traceback for each record it could not write."""
    from gradrepro import cli

    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".parquet"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(logging.FileHandler, "_open", lambda self: _FullDisk())
    argv = [*TINY, f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["gradrepro", *argv])  # hydra.main reads sys.argv
    with pytest.raises(SystemExit) as ended:
        cli.main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 1
    assert "Logging error" not in err and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "incomplete" in lines[0], err
    assert logging.Handler.handleError is not cli._quiet_log_errors  # the process's logging is given back


def test_a_log_handler_that_cannot_write_is_remembered_once(capsys):
    from gradrepro import cli

    handler = logging.FileHandler("/nonexistent-gradrepro/x.log", delay=True)
    handler.stream = _FullDisk()
    record = logging.LogRecord("gradrepro", logging.WARNING, __file__, 1, "disk", None, None)
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        cli._quiet_log_errors(handler, record)
        cli._quiet_log_errors(handler, record)
    cli._say_log_failures()
    cli._LOG_FAILURES.clear()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "x.log" in lines[0] and "No space left on device" in lines[0]
