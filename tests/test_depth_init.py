"""He et al.'s depth/init experiments and Glorot & Bengio's two per-layer statistics.

Fast: every experiment runs end to end at ``scale=tiny`` and records what its signature
reads; the reference measured at init is the control's own step 0; the model-B attenuation
(an at-init measurement, cheap with a small batch) gets opposite verdicts under He and std
0.01. Slow (``-m slow``): every failure experiment at the default scale, on each seed,
reproduces, and its control, evaluated with the same signature, does not (and vice versa).
"""

from __future__ import annotations

import math

import pytest
from conftest import compose_config

from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate

DEPTH = ["depth30_kaiming", "depth30_xavier", "depth30_std001"]
GLOROT = ["glorot_normalized", "glorot_standard"]
VGGB = ["he_vggb_kaiming", "he_vggb_attenuation"]
# Model B at init: a small batch and test set keep the 512-filter convs cheap.
VGGB_SMALL = ("data.batch_size=4", "probe.act_sample=4", "data.n_test=8")


def records_of(result) -> RunRecords:
    return RunRecords(result.scalars, result.modules, result.summary["constants"])


def signature_of(name: str, *overrides: str):
    return compose_config([f"experiment={name}", *overrides]).signature


def test_experiments_are_one_knob_from_their_controls():
    for failure, control in [("depth30_xavier", "depth30_kaiming"),
                             ("depth30_std001", "depth30_kaiming"),
                             ("he_vggb_attenuation", "he_vggb_kaiming"),
                             ("glorot_standard", "glorot_normalized")]:
        a, b = compose_config([f"experiment={failure}"]), compose_config([f"experiment={control}"])
        assert a.control == control
        for key in ("model", "data", "optim", "train", "probe", "threads"):
            assert a[key] == b[key], (failure, key)
        assert a.init.scheme != b.init.scheme
        assert a.init.reference == b.init.reference


def assert_records_what_the_signature_reads(result, name: str) -> None:
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.summary
    assert summary["status"] == "completed"
    for check in summary["checks"]:  # every metric was computable from the records
        assert check["observed"] is not None and math.isfinite(check["observed"]), check
    modules = result.modules
    weights = modules[(modules["step"] == 0) & (modules["param"] == "weight")]
    columns = ["grad_std", "act_grad_std"]
    if name in GLOROT:
        columns += ["pe_act_grad_var", "pe_grad_var"]
    else:
        columns += ["grad_to_decay"]
    for column in columns:
        assert weights[column].notna().all(), column


@pytest.mark.parametrize("name", ["depth30_std001", *GLOROT])
def test_tiny_run_records_what_the_signature_reads(run_in_process, name):
    assert_records_what_the_signature_reads(run_in_process(f"experiment={name}", "scale=tiny"), name)


def test_reference_is_the_controls_own_init(run_in_process):
    """The control (Kaiming) measured as the reference of its own run: identical weights and
    first batch, so the constants equal the run's step-0 records."""
    result = run_in_process("experiment=depth30_kaiming", "scale=tiny")
    assert_records_what_the_signature_reads(result, "depth30_kaiming")
    constants = result.summary["constants"]
    step0 = result.modules[result.modules["step"] == 0].set_index(["module", "param"])
    compared = 0
    for (module, param), row in step0.iterrows():
        for column in ("grad_std", "act_grad_std", "grad_to_decay"):
            key = f"reference/{module}.{param}/{column}"
            if key in constants:
                assert constants[key] == pytest.approx(row[column], rel=1e-5), key
                compared += 1
    assert compared >= 3 * 30


def test_xavier_reference_is_kaiming_and_differs_from_the_run(run_in_process):
    result = run_in_process("experiment=depth30_xavier", "scale=tiny")
    assert_records_what_the_signature_reads(result, "depth30_xavier")
    ref = result.summary["constants"]["reference/features.0.weight/grad_std"]
    own = result.modules.query("step == 0 and module == 'features.0' and param == 'weight'")
    assert ref > 10 * float(own["grad_std"].iloc[0])


def test_vggb_attenuation_reproduces_and_he_control_does_not(run_in_process):
    fail = run_in_process("experiment=he_vggb_attenuation", "scale=tiny", *VGGB_SMALL)
    ctrl = run_in_process("experiment=he_vggb_kaiming", "scale=tiny", *VGGB_SMALL)
    assert fail.returncode == 0 and ctrl.returncode == 0, fail.stderr[-2000:] + ctrl.stderr[-2000:]
    sig_fail = signature_of("he_vggb_attenuation")
    sig_ctrl = signature_of("he_vggb_kaiming")
    assert evaluate(sig_fail, records_of(fail)).reproduced, fail.summary["checks"]
    assert not evaluate(sig_fail, records_of(ctrl)).reproduced
    assert evaluate(sig_ctrl, records_of(ctrl)).reproduced, ctrl.summary["checks"]
    assert not evaluate(sig_ctrl, records_of(fail)).reproduced


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("failure,control", [("depth30_xavier", "depth30_kaiming"),
                                             ("depth30_std001", "depth30_kaiming"),
                                             ("glorot_standard", "glorot_normalized")])
def test_default_scale_failure_reproduces_and_control_does_not(run_in_process, failure, control, seed):
    fail = run_in_process(f"experiment={failure}", f"seed={seed}", timeout=900)
    ctrl = run_in_process(f"experiment={control}", f"seed={seed}", timeout=900)
    assert fail.returncode == 0 and ctrl.returncode == 0
    sig_fail, sig_ctrl = signature_of(failure), signature_of(control)
    assert evaluate(sig_fail, records_of(fail)).reproduced, fail.summary["checks"]
    assert not evaluate(sig_fail, records_of(ctrl)).reproduced, ctrl.summary["checks"]
    assert evaluate(sig_ctrl, records_of(ctrl)).reproduced, ctrl.summary["checks"]
    assert not evaluate(sig_ctrl, records_of(fail)).reproduced


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_scale_vggb_attenuation_on_every_seed(run_in_process, seed):
    fail = run_in_process("experiment=he_vggb_attenuation", f"seed={seed}", timeout=900)
    ctrl = run_in_process("experiment=he_vggb_kaiming", f"seed={seed}", timeout=900)
    assert fail.summary["reproduced"], fail.summary["checks"]
    assert ctrl.summary["reproduced"], ctrl.summary["checks"]
    assert not evaluate(signature_of("he_vggb_attenuation"), records_of(ctrl)).reproduced
