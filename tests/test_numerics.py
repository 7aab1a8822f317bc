"""One rule for quotients of measured values: x/0 is +-inf and a value, 0/0 is NaN; an infinite
observation passes ``>=``; summary.json keeps inf ("inf") apart from NaN (null), and both read
back as floats."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from gradrepro.analysis.tables import runs_table
from gradrepro.numerics import ratio
from gradrepro.records.files import write_json
from gradrepro.records.reader import json_number, read_run
from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate


@pytest.mark.parametrize("num, den, expected", [
    (1.0, 0.0, math.inf), (-2.0, 0.0, -math.inf), (3.0, 2.0, 1.5), (1e-30, 1e-30, 1.0),
])
def test_ratio_of_a_value_over_an_exact_zero_is_infinite(num, den, expected):
    assert ratio(num, den) == expected


@pytest.mark.parametrize("num, den", [(0.0, 0.0), (math.nan, 1.0), (1.0, math.nan)])
def test_ratio_without_anything_to_compare_is_nan(num, den):
    assert math.isnan(ratio(num, den))


def records(constants):
    return RunRecords(pd.DataFrame({"step": [0], "loss": [1.0]}), pd.DataFrame(), constants)


def test_an_infinite_observation_is_a_value_and_nan_holds_nothing():
    checks = [{"metric": "big", "op": ">=", "threshold": 100.0},
              {"metric": "big", "op": "<=", "threshold": 100.0, "role": "context"},
              {"metric": "missing", "op": ">=", "threshold": 0.0, "role": "context"},
              {"metric": "missing", "op": "<=", "threshold": 0.0, "role": "context"}]
    verdict = evaluate({"checks": checks}, records({"big": math.inf}))
    assert [c.ok for c in verdict.checks] == [True, False, False, False]
    assert verdict.reproduced
    assert verdict.checks[0].note == "" and verdict.checks[2].note  # NaN says why


def test_a_ratio_relative_to_a_reference_at_zero_is_infinite():
    own = RunRecords(pd.DataFrame({"step": [0], "x": [2.0]}), pd.DataFrame(),
                     references={"ref": RunRecords(pd.DataFrame({"step": [0], "x": [0.0]}), pd.DataFrame())})
    check = {"metric": "x", "op": ">=", "threshold": 1e6, "params": {"relative_to": "ref", "how": "ratio"}}
    assert evaluate({"checks": [check]}, own).checks[0].observed == math.inf


def test_summary_json_keeps_inf_apart_from_nan_and_reads_both_back(tmp_path):
    summary = {"experiment": "x", "status": "completed", "reproduced": True,
               "checks": [{"metric": "a", "observed": math.inf, "op": ">=", "threshold": 1.0, "ok": True},
                          {"metric": "b", "observed": -math.inf, "op": "<=", "threshold": 1.0, "ok": True},
                          {"metric": "c", "observed": math.nan, "op": ">=", "threshold": 1.0, "ok": False}],
               "constants": {"up": math.inf, "down": float("-inf"), "none": math.nan, "plain": 2.5}}
    write_json(tmp_path / "summary.json", summary)
    stored = json.loads((tmp_path / "summary.json").read_text())  # strict JSON: no Infinity/NaN tokens
    assert [c["observed"] for c in stored["checks"]] == ["inf", "-inf", None]
    assert stored["constants"] == {"up": "inf", "down": "-inf", "none": None, "plain": 2.5}
    pd.DataFrame({"step": [0], "loss": [1.0]}).to_parquet(tmp_path / "scalars.parquet")
    pd.DataFrame({"step": [0], "module": ["m"]}).to_parquet(tmp_path / "modules.parquet")
    run = read_run(tmp_path)
    constants = run.records().constants
    assert constants["up"] == math.inf and constants["down"] == -math.inf and math.isnan(constants["none"])
    row = runs_table([run]).iloc[0]
    assert row["a"] == math.inf and row["b"] == -math.inf and math.isnan(row["c"])
    assert json_number("inf") == math.inf and json_number("text") == "text"
