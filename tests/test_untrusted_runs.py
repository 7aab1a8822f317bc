"""compare and report read run folders as untrusted data: a folder with wrong types, huge or
deeply nested values, special files, YAML bombs or interpolations that would run for ever is
skipped with one warning line (or read without the bad part), and the tables still come out.
Outputs (--out, --plot) refuse what is not a regular, writable file; CSV is one table per file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
from pathlib import Path

import pandas as pd
import pytest
from conftest import compose_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from gradrepro.analysis import compare as compare_cli
from gradrepro.analysis import report as report_cli
from gradrepro.records.files import atomic_write
from gradrepro.records.reader import load_runs, read_run, signature_of
from gradrepro.records.untrusted import load_json, load_yaml
from gradrepro.train import pipeline as runner

TINY = ["scale=tiny", "train.steps=2", "eval.every=0", "probe.every=1"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """A finished control and ablation (simsiam), made once in-process: {name: folder}."""
    root = tmp_path_factory.mktemp("pair")
    out = {}
    for name in ("simsiam_baseline", "simsiam_nostopgrad"):
        overrides = [f"experiment={name}", *TINY]
        cfg = compose_config(overrides)
        runner.run(cfg, root / name, overrides)
        (root / name / ".hydra").mkdir()  # Hydra's own record of the job, unresolved, as Hydra writes it
        (root / name / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (root / name / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
        out[name] = root / name
    return out


def copy_run(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def edit_summary(run_dir: Path, **fields) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(fields)
    (run_dir / "summary.json").write_text(json.dumps(summary))


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail instead of hanging (a FIFO, an endless file, an interpolation that runs for ever)."""
    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_compare(capsys, *args) -> tuple:
    """``python -m gradrepro.compare ARGS`` in-process: (exit code, stdout, stderr lines)."""
    with time_limit(60):
        code = compare_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, [line for line in err.splitlines() if line.strip()]


# --- summary.json of the wrong types ---------------------------------------------------------

BAD_SUMMARIES = {
    "checks as text": {"checks": "all fine"},
    "overrides as a number": {"overrides": 7},
    "steps as text": {"steps": "many"},
    "steps of 4000 digits": {"steps": int("9" * 4000)},
    "a check's threshold null": {"checks": [{"metric": "loss", "op": "<", "threshold": None}]},
    "a check's op unknown": {"checks": [{"metric": "loss", "op": "~", "threshold": 1}]},
    "paper as a list": {"paper": ["a", "b"]},
    "control as a list": {"control": ["simsiam_baseline"]},
    "experiment with a line break": {"experiment": "a\nb"},
    "status unknown": {"status": "great"},
    "seed negative": {"seed": -1},
    "constants as text": {"constants": "x"},
    "a reference outside the folder": {"references": {"r": {"run_dir": "../../etc"}}},
    "signature with a string threshold": {"signature": {"checks": [{"metric": "x", "op": "<", "threshold": "1"}]}},
}


@pytest.mark.parametrize("fields", BAD_SUMMARIES.values(), ids=BAD_SUMMARIES.keys())
def test_a_summary_of_wrong_types_is_skipped_with_one_warning(fields, pair, tmp_path, capsys):
    bad = copy_run(pair["simsiam_nostopgrad"], tmp_path / "bad")
    good = copy_run(pair["simsiam_baseline"], tmp_path / "good")
    edit_summary(bad, **fields)
    code, out, err = run_compare(capsys, tmp_path, "--format", "csv", "--table", "runs")
    assert code == 0
    assert [line for line in err if "warning" in line] == [
        next(line for line in err if str(bad) in line)]
    assert "skipped" in err[0] and "summary.json" in err[0]
    assert list(pd.read_csv(pd.io.common.StringIO(out))["run"]) == [good.name]


def test_json_nested_too_deeply_or_too_large_is_refused(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_json(tmp_path / "deep.json")
    with pytest.raises(ValueError, match="larger than"):
        load_json(tmp_path / "deep.json", limit=1000)


def test_special_files_are_never_opened(pair, tmp_path, capsys):
    fifo = copy_run(pair["simsiam_nostopgrad"], tmp_path / "fifo")
    (fifo / "summary.json").unlink()
    os.mkfifo(fifo / "summary.json")
    zero = copy_run(pair["simsiam_nostopgrad"], tmp_path / "zero")
    (zero / "summary.json").unlink()
    (zero / "summary.json").symlink_to("/dev/zero")
    scalars = copy_run(pair["simsiam_baseline"], tmp_path / "scalars")
    (scalars / "scalars.parquet").unlink()
    os.mkfifo(scalars / "scalars.parquet")
    code, out, err = run_compare(capsys, tmp_path, "--format", "csv", "--table", "runs")
    assert code == 0
    assert any(str(fifo) in w and "a FIFO, not a regular file" in w for w in err)
    assert any(str(zero) in w and "a character device" in w for w in err)
    assert any(str(scalars) in w and "scalars.parquet is unreadable" in w for w in err)
    assert list(pd.read_csv(pd.io.common.StringIO(out))["run"]) == ["scalars"]


def test_yaml_alias_bombs_are_refused_without_expanding(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}]"
              for i in range(1, 12)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nname: x\n")
    with time_limit(20), pytest.raises(ValueError, match="more than .* YAML nodes"):
        load_yaml(tmp_path / "bomb.yaml")


def test_a_killed_run_with_a_yaml_bomb_is_skipped(pair, tmp_path, capsys):
    bomb = copy_run(pair["simsiam_baseline"], tmp_path / "bomb")
    (bomb / "summary.json").unlink()
    text = (bomb / ".hydra" / "config.yaml").read_text()
    aliases = "".join(f"b{i}: &b{i} [*b{i-1}, *b{i-1}, *b{i-1}, *b{i-1}, *b{i-1}, *b{i-1}, *b{i-1}, *b{i-1}]\n"
                      for i in range(1, 14))
    (bomb / ".hydra" / "config.yaml").write_text("b0: &b0 [x, x]\n" + aliases + text)
    copy_run(pair["simsiam_nostopgrad"], tmp_path / "fine")
    code, out, err = run_compare(capsys, tmp_path, "--format", "csv", "--table", "runs")
    assert code == 0 and any(str(bomb) in w and "YAML nodes" in w for w in err)


def test_interpolations_of_a_run_folder_are_never_evaluated(pair, tmp_path, capsys):
    """The pair table evaluates the ablation's signature on its control: it reads the
    signature the run recorded, never the folder's ${calc:...}, which would run for ever."""
    ablation = copy_run(pair["simsiam_nostopgrad"], tmp_path / "ablation")
    copy_run(pair["simsiam_baseline"], tmp_path / "control")
    config = ablation / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("threshold: ${calc:'0.5 / sqrt(${objective.dim})'}",
                                                 "threshold: ${calc:'9**9**9**9'}"))
    assert "9**9**9**9" in config.read_text()
    code, out, err = run_compare(capsys, tmp_path, "--format", "json")
    assert code == 0 and len(json.loads(out)["pairs"]) == 1  # from the recorded signature
    # A run from before summaries recorded their signature: its interpolation is refused.
    summary = json.loads((ablation / "summary.json").read_text())
    del summary["signature"]
    (ablation / "summary.json").write_text(json.dumps(summary))
    assert signature_of(read_run(ablation)) is None
    code, out, err = run_compare(capsys, tmp_path, "--format", "json")
    assert code == 0 and "pairs" not in json.loads(out)
    assert any("cannot evaluate its signature" in w for w in err)


def test_plot_skips_a_run_whose_records_lack_a_step_column(pair, tmp_path, capsys):
    bad = copy_run(pair["simsiam_nostopgrad"], tmp_path / "runs" / "bad")
    copy_run(pair["simsiam_baseline"], tmp_path / "runs" / "good")
    frame = pd.read_parquet(bad / "scalars.parquet").drop(columns=["step"])
    frame.to_parquet(bad / "scalars.parquet")
    code, out, err = run_compare(capsys, tmp_path / "runs", "--plot", tmp_path / "cmp.png",
                                 "--out", tmp_path / "t.md")
    assert code == 0 and (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    assert any(str(bad) in w and "no numeric 'step' column" in w for w in err)
    assert "1 runs drawn" in err[-1]


# --- generated summaries: whatever a summary holds, compare never breaks -------------------

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["experiment", "control", "status", "reproduced", "checks", "overrides", "steps", "seed",
          "wall_s", "constants", "paper", "references", "signature", "missing", "claim"]


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_generated_summaries_never_break_compare(changes, pair, tmp_path_factory, capsys):
    root = tmp_path_factory.mktemp("generated")
    copy_run(pair["simsiam_baseline"], root / "good")
    bad = copy_run(pair["simsiam_nostopgrad"], root / "bad")
    edit_summary(bad, **changes)
    code, out, err = run_compare(capsys, root, "--format", "json")
    assert code == 0
    assert all(line.startswith("gradrepro.compare: ") for line in err)  # one line per message
    assert "good" in [r["run"] for r in json.loads(out)["runs"]]


# --- outputs ---------------------------------------------------------------------------------


def test_csv_gives_one_table_per_file_each_readable_by_pandas(pair, tmp_path, capsys):
    code, out, err = run_compare(capsys, *pair.values(), "--format", "csv", "--out", tmp_path / "cmp.csv")
    assert code == 0
    runs = pd.read_csv(tmp_path / "cmp.csv")
    groups = pd.read_csv(tmp_path / "cmp.groups.csv")
    pairs = pd.read_csv(tmp_path / "cmp.pairs.csv")
    assert len(runs) == 2 and len(groups) == 2 and len(pairs) == 1
    assert "cmp.groups.csv (groups)" in err[-1]
    code, out, err = run_compare(capsys, *pair.values(), "--format", "csv", "--table", "groups")
    assert len(pd.read_csv(pd.io.common.StringIO(out))) == 2


@pytest.mark.parametrize("target", ["/dev/null", "folder", "fifo", "link_to_device"])
def test_out_and_plot_refuse_what_is_not_a_regular_file(target, pair, tmp_path, capsys):
    path = {"/dev/null": Path("/dev/null"), "folder": tmp_path / "folder",
            "fifo": tmp_path / "fifo", "link_to_device": tmp_path / "link"}[target]
    if target == "folder":
        path.mkdir()
    elif target == "fifo":
        os.mkfifo(path)
    elif target == "link_to_device":
        path.symlink_to("/dev/null")
    for option in ("--out", "--plot"):
        code, out, err = run_compare(capsys, pair["simsiam_baseline"], option, path)
        assert code == 2 and len(err) == 1 and "not a regular file" in err[0], err
    assert Path("/dev/null").is_char_device()


def test_a_read_only_target_is_one_line(pair, tmp_path, capsys):
    locked = tmp_path / "locked.md"
    locked.write_text("keep me\n")
    locked.chmod(0o444)
    code, out, err = run_compare(capsys, pair["simsiam_baseline"], "--out", locked)
    assert code == 2 and len(err) == 1 and "read-only" in err[0]
    assert locked.read_text() == "keep me\n"
    # A file system that refuses the write (read-only for every user, root included).
    code, out, err = run_compare(capsys, pair["simsiam_baseline"], "--out", "/proc/gradrepro.md")
    assert code == 2 and len(err) == 1 and "gradrepro.compare: error:" in err[0]


def test_report_skips_bad_runs_and_refuses_a_bad_output(pair, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    copy_run(pair["simsiam_baseline"], sweep / "a")
    null = copy_run(pair["simsiam_nostopgrad"], sweep / "b")
    edit_summary(null, checks=[{"metric": "z_std", "op": "<", "threshold": None}])
    with time_limit(120):
        code = report_cli.main(["--from-sweep", str(sweep), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err
    assert "threshold' must be a number" in err and (tmp_path / "out" / "README.md").exists()
    code = report_cli.main(["--from-sweep", str(sweep), "--out", "/dev/null"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "'/dev/null' is not a folder" in err[0]


# --- kill -9 leftovers -----------------------------------------------------------------------


def test_temporaries_of_a_killed_writer_are_removed_and_never_read(pair, tmp_path, capsys):
    run = copy_run(pair["simsiam_baseline"], tmp_path / "run")
    dead = 2**22 + 12345  # above Linux's default pid_max: no process has it
    stale = run / f".modules.parquet.{socket.gethostname()}-{dead}.abc123.tmp"
    stale.write_bytes(b"half a parquet file")
    foreign = run / ".scalars.parquet.otherhost-1.xyz.tmp"
    foreign.write_bytes(b"another machine's write in progress")
    runs, warnings = load_runs([tmp_path])
    assert len(runs) == 1 and not warnings  # compare does not see them
    atomic_write(run / "notes.txt", lambda tmp: Path(tmp).write_text("x"))
    assert not stale.exists() and foreign.exists()


def test_status_names_records_that_were_not_all_written(pair, tmp_path):
    run = copy_run(pair["simsiam_baseline"], tmp_path / "run")
    edit_summary(run, missing=["modules.parquet: not written (No space left on device)"])
    got = read_run(run)
    assert not got.complete and "records not all written" in got.status
    assert math.isfinite(got.final_loss)
