"""End to end through the real CLI at scale=tiny: every experiment writes the run
directory of the contract (README, "The run folder"), and bad input is one line with
exit code 2."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import CONFIGS, compose_config, experiment_names, flat_config

from gradrepro.analysis.catalog import NOT_KNOBS

SUMMARY_KEYS = {
    "experiment", "control", "reproduced", "checks", "paper", "status", "steps", "wall_s",
    "seed", "overrides", "versions", "device",
}
MODULE_COLUMNS = {
    "step", "module", "param", "param_type", "grad_state", "grad_norm", "param_norm",
    "grad_to_param", "update_to_param", "frac_none", "frac_zero", "frac_nonfinite",
    "frac_fp16_underflow", "act_mean", "act_std", "act_grad_std",
}


@pytest.mark.parametrize("experiment", experiment_names())
def test_every_experiment_writes_the_run_directory_contract(tiny_runs, experiment):
    run_dir = tiny_runs[experiment]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["status"] == "completed"
    assert isinstance(summary["reproduced"], bool)
    for check in summary["checks"]:
        assert {"metric", "observed", "op", "threshold", "ok"} <= set(check)
    assert {"python", "torch", "gradrepro", "git_commit"} <= set(summary["versions"])
    scalars = pd.read_parquet(run_dir / "scalars.parquet")
    assert {"step", "loss"} <= set(scalars.columns)
    assert scalars["step"].is_monotonic_increasing and scalars["step"].is_unique
    modules = pd.read_parquet(run_dir / "modules.parquet")
    assert MODULE_COLUMNS <= set(modules.columns)
    assert len(modules) > 0
    assert set(modules["grad_state"]) <= {"none", "zero", "tiny", "finite", "nonfinite"}
    assert (run_dir / "signals.png").stat().st_size > 10_000
    assert (run_dir / ".hydra" / "config.yaml").exists()


def test_single_run_prints_the_verdict_table(cli):
    result = cli("experiment=simsiam_nostopgrad", "scale=tiny")
    assert result.returncode == 0, result.stderr
    assert "simsiam_nostopgrad: signature" in result.stdout
    assert "paper" in result.stdout and "observed" in result.stdout
    assert result.summary["control"] == "simsiam_baseline"
    assert "objective.stop_gradient" not in result.summary["overrides"]  # the experiment sets it
    # The run's key scalars are recorded: collapse statistic and k-NN accuracy.
    assert {"z_std", "knn_acc"} <= set(result.scalars.columns)
    assert "knn_acc_init" in result.summary["constants"]
    # SimSiam has two loss terms: their separate contributions are recorded per module.
    assert {"contrib_p1_z2", "contrib_p2_z1"} <= set(result.modules.columns)


# What an experiment may change beside its one knob: its identity, its verdict, its display
# (the catalogue's own list, which computes the README's knob column).
BOOKKEEPING = tuple(k + sep for k in NOT_KNOBS for sep in (".", ""))


@pytest.mark.parametrize("experiment", [e for e in experiment_names()
                                        if compose_config([f"experiment={e}"]).control])
def test_every_experiment_is_one_knob_away_from_its_control(experiment):
    ablation = flat_config(compose_config([f"experiment={experiment}"]))
    control = flat_config(compose_config([f"experiment={ablation['control']}"]))
    changed = {k for k in ablation.keys() | control.keys() if ablation.get(k) != control.get(k)}
    knobs = {k for k in changed if not k.startswith(BOOKKEEPING)}
    # One knob: one key, or one config-group choice (precision=fp16_dynamic sets its mode
    # and its loss scale together), so the changed keys lie under a single group.
    groups = {k.split(".")[0] for k in knobs}
    assert len(knobs) == 1 or (len(groups) == 1 and (CONFIGS / groups.pop()).is_dir()), knobs


BAD_INPUTS = [
    ("experiment=simsiam_nostopgrd", "did you mean 'simsiam_nostopgrad'"),
    ("train.stesp=3", "train.stesp"),
    ("train.steps=abc", "train.steps"),
    ("train.steps=-1", "train.steps=-1 must be"),
    ("probe.every=0", "probe.every=0 must be"),
    ("optim.lr=0", "optim.lr=0"),
    ("model=resnet99", "valid choices"),
    ("data=cifar10", "does not hold CIFAR-10"),
    ("device=tpu", "choose one of: auto, cpu, cuda"),
]


@pytest.mark.parametrize("override, expected", BAD_INPUTS)
def test_preflight_names_the_problem(override, expected):
    from gradrepro.cli import preflight
    from gradrepro.errors import UserError

    with pytest.raises(UserError) as info:
        preflight.check(["experiment=simsiam_baseline", override, "scale=tiny"])
    message = str(info.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("override", ["train.stesp=3", "experiment=nope"])
def test_bad_input_is_one_line_and_exit_code_2(cli, override):
    result = cli("experiment=simsiam_baseline", override, "scale=tiny")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gradrepro: error: ")
    assert "Traceback" not in result.stderr
    assert not (result.run_dir / "summary.json").exists()
