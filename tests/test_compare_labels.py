"""What compare and the report print means one thing and is computed from the runs read: a
column holds one quantity (a reduced value has its own name), runs of different software
versions are said to be, markdown fits 120 columns, and a report from an existing folder
states only what those runs show."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradrepro
from gradrepro.analysis import report
from gradrepro.analysis.compare import compare
from gradrepro.analysis.fit_width import markdown_within
from gradrepro.analysis.tables import check_keys, render

torch.set_num_threads(1)

params = st.dictionaries(st.sampled_from(["reduce", "column", "relative_to", "scale", "from_step", "window"]),
                         st.sampled_from(["change", "max", "loss", "fp32", 0.5, 1, 3]), max_size=3)


@settings(max_examples=60, deadline=None)
@given(a=params, b=params, metric=st.sampled_from(["knn_acc", "loss", "z_std"]))
def test_one_column_one_quantity(a, b, metric):
    """Two checks of one metric get one column only where they read the same quantity (the
    ``window`` over which it is averaged aside)."""
    same = {k: v for k, v in a.items() if k != "window"} == {k: v for k, v in b.items() if k != "window"}
    key_a, key_b = (check_keys([{"metric": metric, "params": p}])[0] for p in (a, b))
    assert (key_a == key_b) == same
    assert key_a.startswith(metric)


def test_a_reduced_value_is_not_named_as_the_metric():
    keys = check_keys([{"metric": "knn_acc", "params": {"reduce": "change", "window": 1}},
                       {"metric": "knn_acc", "params": {"window": 1}}])
    assert keys == ["knn_acc gain", "knn_acc"]


def test_the_printed_verdict_names_the_gain_and_shows_it():
    """A check on a gain prints the gain's name and the gain, in the run's printed table, in
    summary.json's check (``quantity``) and in the checks table's ``check`` column."""
    import math

    from gradrepro.analysis.checks import checks_table  # noqa: F401 - the column is built there
    from gradrepro.records.run import RunRecords
    from gradrepro.signature import evaluate, format_verdict

    scalars = pd.DataFrame({"step": [0, 10, 20], "linear_acc": [0.2, math.nan, 0.9], "loss": [0.0, -0.5, -0.9]})
    signature = {"window": 1, "checks": [
        {"metric": "linear_acc", "params": {"reduce": "change", "window": 1}, "op": ">=", "threshold": 0.067},
        {"metric": "linear_acc", "params": {"window": 1}, "op": ">=", "threshold": 0.5},
        {"metric": "loss", "params": {"relative_to": "fp32"}, "op": "<=", "threshold": 2, "role": "context"}]}
    verdict = evaluate(signature, RunRecords(scalars, pd.DataFrame(), {}))
    assert [c.quantity for c in verdict.checks] == ["linear_acc gain", "linear_acc", "loss / loss[fp32]"]
    assert verdict.checks[0].observed == pytest.approx(0.7)
    lines = format_verdict(verdict, "x").splitlines()
    assert lines[1].split()[:2] == ["quantity", "observed"]
    gain = next(line for line in lines[2:] if "gain" in line)
    assert gain.split()[:4] == ["linear_acc", "gain", "0.7", ">="]
    assert verdict.as_dicts()[0]["quantity"] == "linear_acc gain"


def recording(folder: Path, experiment: str, control, versions: dict, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, folder, every=1) as rec:
        for _ in range(2):
            opt.zero_grad()
            loss = F.mse_loss(model(torch.randn(4, 3)), torch.zeros(4, 2))
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    summary = json.loads((folder / "summary.json").read_text())
    summary.update(experiment=experiment, control=control, seed=seed, versions={**summary["versions"], **versions})
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_runs_of_different_versions_are_said_to_be(tmp_path):
    recording(tmp_path / "a", "ablation", "base", {"torch": "2.4.0"})
    recording(tmp_path / "b", "base", None, {"torch": "2.14.1"})
    recording(tmp_path / "c", "other", None, {"torch": "2.14.1"})
    tables, runs, warnings = compare([tmp_path])
    assert tables["runs"].set_index("experiment")["torch version"].to_dict() == {
        "ablation": "2.4.0", "base": "2.14.1", "other": "2.14.1"}
    straddle = [w for w in warnings if "different versions" in w]
    assert len(straddle) == 1 and "ablation" in straddle[0] and "2.4.0" in straddle[0]
    same, _, same_warnings = compare([tmp_path / "b", tmp_path / "c"])
    assert "torch version" not in same["runs"] and not [w for w in same_warnings if "versions" in w]


@settings(max_examples=25, deadline=None)
@given(columns=st.integers(1, 30), cell=st.integers(1, 80), rows=st.integers(1, 4))
def test_markdown_fits_120_columns(columns, cell, rows):
    df = pd.DataFrame({f"column_{i}": ["v" * cell] * rows for i in range(columns)})
    text = markdown_within(df, 120)
    assert max(len(line) for line in text.splitlines()) <= 120
    for i in range(columns):  # nothing dropped: every column is in some block
        assert f"column_{i}" in text


def test_compare_markdown_fits_120_columns_and_wide_keeps_the_long_form(tmp_path):
    for i in range(4):
        recording(tmp_path / ("a_rather_long_folder_name_for_a_run_of_this_sweep" + str(i)), "ablation", None, {})
    tables, _, _ = compare([tmp_path])
    assert max(len(line) for line in render(tables, "markdown").splitlines()) <= 120
    assert "a_rather_long_folder_name_for_a_run_of_this_sweep0" in render(tables, "markdown", width=None)


def test_a_report_from_recordings_states_only_what_they_show(tmp_path):
    for i in range(2):
        recording(tmp_path / "recs" / f"r{i}", f"mine{i}", None, {}, seed=i)
    assert report.main(["--from-sweep", str(tmp_path / "recs"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "README.md").read_text()
    assert "2 experiments, 2 runs (2 recorded in a user's own loop" in text
    assert "1 seed per experiment" not in text or "(0)" not in text  # seeds 0 and 1: not one shared seed
    for absent in ("3 seeds", "joblib", "This is a control", "\n.", "python -m gradrepro experiment="):
        assert absent not in text, absent
    assert "No claim recorded." in text and "no control" in text
