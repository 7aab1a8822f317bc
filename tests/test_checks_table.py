"""The checks table (``python -m gradrepro.compare DIR --table checks``): each failure's checks on
its own records and on its control's, seed by seed, on small synthetic run folders; and the
rule every failure experiment's signature follows (at least one evidence check)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import compose_config, composed, experiment_names, run_module

from gradrepro.analysis.checks import checks_table, margin, margins_table
from gradrepro.analysis.compare import compare
from gradrepro.measure.reference_runs import made_references
from gradrepro.records.reader import load_runs
from gradrepro.signature import quantity

# A failure's signature: one evidence check on the loss, one relative to a reference run, one
# context check that holds on both.
SIGNATURE = {"window": 1, "checks": [
    {"metric": "loss", "op": ">=", "threshold": 1.0, "role": "evidence", "paper": "stays high"},
    {"metric": "loss", "op": ">=", "threshold": 2.0, "role": "evidence",
     "params": {"relative_to": "healthy", "how": "ratio"}},
    {"metric": "lr", "op": "<=", "threshold": 1.0, "role": "context"},
    {"metric": "not_recorded", "op": "<=", "threshold": 1.0, "role": "context"},
]}


def write_run(folder: Path, experiment: str, seed: int, loss: float, control: str | None = None,
              references: dict | None = None, signature: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    pd.DataFrame({"step": [0, 1], "loss": [loss, loss], "lr": [0.1, 0.1]}).to_parquet(folder / "scalars.parquet")
    pd.DataFrame({"step": [0], "module": ["fc"], "param": ["weight"], "param_type": ["linear"],
                  "grad_norm": [1.0]}).to_parquet(folder / "modules.parquet")
    summary = {"experiment": experiment, "control": control, "seed": seed, "status": "completed",
               "overrides": [f"experiment={experiment}", f"seed={seed}"], "constants": {},
               "references": {name: {"experiment": exp, "run_dir": f"references/{name}"}
                              for name, exp in (references or {}).items()}}
    if signature is not None:
        summary["signature"] = signature
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def write_pair(root: Path, seed: int, failure_loss: float = 2.3, control_loss: float = 0.3,
               control_reference: bool = False, replicate_loss: float = 0.25) -> None:
    failure = write_run(root / f"failure_{seed}", "fail", seed, failure_loss, control="ok",
                        references={"healthy": "ok"}, signature=SIGNATURE)
    write_run(failure / "references" / "healthy", "ok", seed, control_loss)
    control = write_run(root / f"control_{seed}", "ok", seed, control_loss,
                        references={"healthy": "ok"} if control_reference else None)
    if control_reference:  # the control's reference to its own experiment: a replicate, another seed
        write_run(control / "references" / "healthy", "ok", seed + 1_000_003, replicate_loss)


def table(root: Path) -> pd.DataFrame:
    runs, warnings = load_runs([root])
    return checks_table(runs)


def test_one_row_per_failure_seed_and_check_with_both_sides(tmp_path):
    for seed in (0, 1):
        write_pair(tmp_path, seed)
    df = table(tmp_path)
    assert len(df) == 2 * len(SIGNATURE["checks"])
    first = df[(df["seed"] == 0) & (df["check"] == "0: loss")].iloc[0]
    assert first[["experiment", "control", "role", "op", "threshold"]].tolist() == ["fail", "ok", "evidence", ">=", 1.0]
    assert first["ok_failure"] and first["ok_control"] is False
    assert first["observed_failure"] == pytest.approx(2.3) and first["observed_control"] == pytest.approx(0.3)
    assert first["margin_failure"] == pytest.approx(1.3) and first["margin_control"] == pytest.approx(0.7)
    context = df[(df["seed"] == 0) & (df["check"] == "2: lr")].iloc[0]
    assert context["role"] == "context" and context["ok_failure"] and context["ok_control"]


def test_the_control_answers_with_its_own_reference_runs_and_nothing_is_lent(tmp_path):
    write_pair(tmp_path / "own", 0, control_reference=True)
    write_pair(tmp_path / "none", 0)
    own = table(tmp_path / "own").query("check == '1: loss / loss[healthy]'").iloc[0]
    assert own["observed_failure"] == pytest.approx(2.3 / 0.3)
    assert own["observed_control"] == pytest.approx(0.3 / 0.25)  # against its replicate, not itself
    assert own["ok_failure"] and own["ok_control"] is False
    # Without a reference of its own the control cannot answer: n/a, never the failure's run lent.
    bare = table(tmp_path / "none").query("check == '1: loss / loss[healthy]'").iloc[0]
    assert bare["ok_failure"] and bare["ok_control"] is None and math.isnan(bare["observed_control"])
    assert "healthy" in bare["note"] and "not recorded" in bare["note"]
    assert "control_refs" not in bare.index


def test_what_the_control_cannot_answer_is_na_never_a_failure(tmp_path):
    write_pair(tmp_path, 0)
    write_run(tmp_path / "orphan", "fail", 5, 2.3, control="ok", references={}, signature=SIGNATURE)
    df = table(tmp_path)
    unrecorded = df[(df["seed"] == 0) & (df["check"] == "3: not_recorded")].iloc[0]
    assert unrecorded["ok_control"] is None and math.isnan(unrecorded["observed_control"])
    orphan = df[df["seed"] == 5]
    assert orphan["ok_control"].isna().all() and (orphan["note"] == "no ok run of this seed").all()
    margins = margins_table(df).set_index("check")
    assert margins.loc["0: loss", "fails_on_control"] == "1/1" and margins.loc["0: loss", "control_n/a"] == 1
    assert margins.loc["3: not_recorded", "fails_on_control"] == "0/0"


def test_margins_over_seeds_take_the_smallest_on_each_side(tmp_path):
    write_pair(tmp_path, 0, failure_loss=2.3, control_loss=0.3)
    write_pair(tmp_path, 1, failure_loss=1.1, control_loss=0.9)
    row = margins_table(table(tmp_path)).set_index("check").loc["0: loss"]
    assert row["holds_on_failure"] == "2/2" and row["fails_on_control"] == "2/2"
    assert row["min_margin_failure"] == pytest.approx(0.1) and row["min_margin_control"] == pytest.approx(0.1)
    assert row["at_seed_failure"] == row["at_seed_control"] == 1
    assert margin(0.5, "<=", 1.0) == 0.5 and margin(2.0, "<", 1.0) == -1.0 and math.isnan(margin(math.nan, ">", 0))


def test_the_cli_writes_the_table_in_every_format(tmp_path):
    write_pair(tmp_path / "runs", 0)
    for fmt, name in (("csv", "checks.csv"), ("markdown", "checks.md"), ("json", "checks.json")):
        out = tmp_path / name
        proc = run_module("gradrepro.compare", str(tmp_path / "runs"), "--table", "checks", "--format", fmt,
                          "--out", str(out), timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "ok_control" in out.read_text()
    df = pd.read_csv(tmp_path / "checks.csv")
    # each check named by the quantity it compares: the ratio to the reference run is not the loss
    assert list(df["check"]) == [f"{i}: {quantity(c['metric'], c.get('params'))}"
                                 for i, c in enumerate(SIGNATURE["checks"])]
    assert list(df["check"])[:2] == ["0: loss", "1: loss / loss[healthy]"]
    proc = run_module("gradrepro.compare", str(tmp_path / "runs"), "--table", "checks", "--signatures", "cached",
                      timeout=120)
    assert proc.returncode == 2 and "--signatures" in proc.stderr and "current" in proc.stderr


def test_current_signatures_come_from_the_package_configs(tmp_path):
    # A run recorded before its signature changed: evaluated with the config's signature now.
    write_run(tmp_path / "f", "glorot_standard", 0, 2.3, control="glorot_normalized", signature=SIGNATURE)
    write_run(tmp_path / "c", "glorot_normalized", 0, 2.3)
    tables, _, _ = compare([tmp_path], signatures="current")
    checks = tables["checks"]
    expected = compose_config(["experiment=glorot_standard"]).signature.checks
    assert [c.split(": ")[1] for c in checks["check"]] == [quantity(c.metric, c.get("params")) for c in expected]
    assert set(checks["role"]) == {"evidence", "context"}


@functools.lru_cache(maxsize=None)
def declared(experiment: str) -> tuple:
    """(control, checks) of an experiment's config at scale=tiny (composed once per session)."""
    cfg = composed(experiment, "scale=tiny")
    return cfg.control, [dict(c) for c in cfg.signature.checks]


def failure_experiments():
    return [e for e in experiment_names() if declared(e)[0]]


@pytest.mark.parametrize("experiment", failure_experiments())
def test_every_failure_experiment_has_an_evidence_check(experiment):
    checks = declared(experiment)[1]
    roles = [c.get("role") or "evidence" for c in checks]
    assert "evidence" in roles, f"{experiment}: no evidence check (a verdict needs one)"
    assert all(c.get("paper") for c in checks), f"{experiment}: a check without its source"



REFERENCE_PARAMS = ("relative_to", "closer_to", "than", "reference")


@pytest.mark.parametrize("experiment", failure_experiments())
def test_every_control_makes_the_references_its_failures_checks_name(experiment):
    # A control answers a relative check with a reference run of its own; one of its own
    # experiment is a replicate with another seed (measure/reference_runs.py), never a copy.
    control = composed(experiment, "scale=tiny").control
    names = {c["params"][k] for c in declared(experiment)[1] for k in REFERENCE_PARAMS
             if c.get("params") and c["params"].get(k)}
    made = made_references(composed(control, "scale=tiny"))
    assert names <= set(made), f"{control} makes no reference run named {sorted(names - set(made))}"


def test_the_table_over_every_pair_of_the_suite_at_tiny_scale(tiny_runs):
    # At scale=tiny signatures need not discriminate: this checks the table, not the verdicts.
    tables, runs, _ = compare(list(tiny_runs.values()))
    checks = tables["checks"]
    failures = sorted(e for e in failure_experiments())
    assert sorted(checks["experiment"].unique()) == failures
    for experiment, rows in checks.groupby("experiment"):
        assert len(rows) == len(declared(experiment)[1]) and (rows["role"] == "evidence").any(), experiment
        assert not rows["note"].str.startswith("no ").any(), experiment  # its control was found
        answered = rows["ok_control"].notna()
        assert (rows.loc[~answered, "observed_control"].isna()).all(), experiment  # n/a only when nothing observed
    assert set(tables["margins"]["experiment"]) == set(failures)
