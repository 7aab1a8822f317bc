"""SimSiam's signatures against their controls: each failure signature reproduces on its
own records and not on the control's, and the other way round (opposite verdicts)."""

from __future__ import annotations

import contextlib
import io

import pytest
from conftest import compose_config, read_tables
from omegaconf import OmegaConf

from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate
from gradrepro.train.pipeline import run


def run_experiment(tmp_path, name, *overrides):
    cfg = compose_config([f"experiment={name}", *overrides])
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg, tmp_path / name.replace("/", "_"))
    summary, scalars, modules = read_tables(tmp_path / name.replace("/", "_"))
    return cfg, summary, RunRecords(scalars, modules, summary["constants"])


# A quarter of the default scale (1,200 steps) but past the point where, at the default,
# the no-stop-gradient run has collapsed into the backbone and the baseline's k-NN has
# risen (seed 0 at step 300: k-NN 0.12 and 0.985, see experiments/simsiam.md); a genuine
# run, not a fixture.
SHORT = ("train.steps=300", "eval.every=150")


def test_nostopgrad_collapses_and_control_does_not(tmp_path):
    ablation_cfg, ablation, ablation_records = run_experiment(tmp_path, "simsiam_nostopgrad", *SHORT)
    control_cfg, control, control_records = run_experiment(tmp_path, "simsiam_baseline", *SHORT)
    assert ablation["reproduced"] is True, ablation["checks"]
    assert control["reproduced"] is True, control["checks"]
    # The same signatures on the other run's records give the opposite verdict.
    assert evaluate(ablation_cfg.signature, control_records).reproduced is False
    assert evaluate(control_cfg.signature, ablation_records).reproduced is False


def test_frozen_predictor_does_not_converge_nor_collapse_but_its_accuracy_stays_high(tmp_path):
    frozen_cfg, frozen, frozen_records = run_experiment(tmp_path, "simsiam_frozen_predictor", *SHORT)
    nostop_cfg = compose_config(["experiment=simsiam_nostopgrad"])
    checks = {c["metric"]: c for c in frozen["checks"]}
    assert checks["progress_to"]["ok"] and checks["z_std"]["ok"], frozen["checks"]  # Table 1b's "no convergence"
    # Table 1b's accuracy (1.5%) does not reproduce at this scale (experiments/simsiam.md):
    # the accuracy check fails, and with it the verdict.
    assert not checks["knn_acc"]["ok"] and frozen["reproduced"] is False, frozen["checks"]
    # Not collapse: the collapse signature does not fire on the frozen predictor's records.
    assert evaluate(nostop_cfg.signature, frozen_records).reproduced is False
    assert "predictor.0.weight" in frozen["frozen"]


# The predictor ablations' headline accuracy (Table 1: 0.1%, 1.5%) does not reproduce at
# this scale (experiments/simsiam.md): their verdict is NOT REPRODUCED.
EXPECTED = {"simsiam_baseline": True, "simsiam_nostopgrad": True, "simsiam_nopredictor": False,
            "simsiam_frozen_predictor": False}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_default_scale_verdicts_on_every_seed(tmp_path, name, seed):
    cfg, summary, _ = run_experiment(tmp_path, name, f"seed={seed}")
    assert summary["reproduced"] is EXPECTED[name], OmegaConf.to_yaml(cfg.signature) + str(summary["checks"])
