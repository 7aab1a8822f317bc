"""Signature params and metrics for interval and progress checks: ``transform: abs_log2`` (one
check for "within a factor of 2"), ``how: abs_difference`` against a reference run,
``progress_to``, and ``grad_attenuation_over_derived`` (He et al.'s Eq. 14 per layer)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from conftest import compose_config

from gradrepro.config.validate import validate
from gradrepro.errors import UserError
from gradrepro.models.plainnet import PlainNet, PlainNetConfig
from gradrepro.recipe.init import initialize
from gradrepro.records.run import RunRecords, reference_constant
from gradrepro.signature import derivation, evaluate


def records(loss, acc=None, modules=None, constants=None, references=None) -> RunRecords:
    scalars = pd.DataFrame({"step": range(len(loss)), "loss": loss})
    if acc is not None:
        scalars["test_acc"] = acc
    return RunRecords(scalars, modules if modules is not None else pd.DataFrame(), constants or {},
                      references or {})


def observed(check, recs, window=1):
    return evaluate({"window": window, "checks": [check]}, recs).checks[0]


def test_abs_log2_is_one_check_that_fails_on_either_side_of_a_factor_two():
    def check(value):
        return observed({"metric": "loss", "op": "<=", "threshold": 1, "params": {"transform": "abs_log2"}},
                        records([value]))

    assert check(2.0).ok and check(0.5).ok and check(1.0).observed == 0
    assert not check(2.1).ok and not check(0.45).ok
    assert check(0.0).observed == math.inf and not check(0.0).ok  # log of 0: infinitely far
    assert math.isnan(check(-1.0).observed)


def test_abs_difference_to_a_reference_run_is_symmetric():
    ref = records([1.0], acc=[0.95])
    check = {"metric": "test_acc", "op": "<=", "threshold": 0.1,
             "params": {"relative_to": "fp32", "how": "abs_difference"}}
    assert observed(check, records([1.0], acc=[0.90], references={"fp32": ref})).observed == pytest.approx(0.05)
    assert observed(check, records([1.0], acc=[1.0], references={"fp32": ref})).ok
    assert not observed(check, records([1.0], acc=[0.57], references={"fp32": ref})).ok


def test_progress_to_is_the_fraction_of_the_way_from_the_first_value_to_the_target():
    check = {"metric": "progress_to", "op": ">=", "threshold": 0.5, "params": {"column": "loss", "target": -1}}
    curve = records([0.0, -0.5, -0.9, -0.97])
    assert observed(check, curve).observed == pytest.approx(0.97)
    assert observed(check, curve, window=3).observed == pytest.approx((0.5 + 0.9 + 0.97) / 3)
    assert observed(check, records([-0.1, -0.3])).observed == pytest.approx(0.2 / 0.9)
    diverging = observed(dict(check, params={"column": "loss", "target": 0}), records([2.3, 1e9]))
    assert diverging.observed < 0 and not diverging.ok
    assert math.isnan(observed(check, records([-1.0])).observed)  # one value: no way travelled
    assert math.isnan(observed(check, records([-1.0, -1.0])).observed)  # started at the target


def test_initialize_records_each_weights_fans_and_std():
    # depth 4 with one hidden fc layer: 2 convs of 4 filters on 2x2 maps, then fc 16 -> 3 -> 2.
    net = PlainNet(PlainNetConfig(in_channels=1, image_size=2, num_classes=2, depth=4, width=4, fc_widths=[3]))
    facts = initialize(net, "xavier")
    layers = [n.rpartition("/")[0].removeprefix("init/") for n in facts if n.endswith("/std")]
    assert [(facts[f"init/{w}/fan_in"], facts[f"init/{w}/fan_out"]) for w in layers] == [
        (9, 36), (36, 36), (16, 3), (3, 2)]
    assert facts[f"init/{layers[1]}/std"] == pytest.approx(math.sqrt(1 / 36))
    assert initialize(net, "default") == {}  # PyTorch's own init: nothing drawn by a scheme


def test_weight_grad_attenuation_multiplies_one_std_ratio_per_layer_above():
    xavier = [math.sqrt(1 / 9), math.sqrt(1 / 36), math.sqrt(1 / 16), math.sqrt(1 / 3)]
    kaiming = [math.sqrt(2) * s for s in xavier]
    assert derivation.weight_grad_attenuation(xavier, kaiming, 0) == pytest.approx(2 ** 1.5)
    assert derivation.weight_grad_attenuation(xavier, kaiming, 3) == 1.0  # nothing above
    # std 0.01 against Kaiming: sqrt(2 / fan_in) / 0.01 for each layer above the first
    expected = math.prod(k / 0.01 for k in kaiming[1:])
    assert derivation.weight_grad_attenuation([0.01] * 4, kaiming, 0) == pytest.approx(expected)


def test_grad_attenuation_over_derived_is_one_when_eq14_holds():
    names, kinds = ["features.0", "features.2", "classifier.0", "classifier.2"], ["conv", "conv", "linear", "linear"]
    own, ref = [0.5, 0.25, 0.125, 1.0], [1.0, 1.0, 0.5, 2.0]
    derived = derivation.weight_grad_attenuation(own, ref, 0)  # 4 * 4 * 2
    rows = pd.DataFrame([{"step": 0, "module": n, "param": "weight", "param_type": k, "grad_std": 1e-30}
                         for n, k in zip(names, kinds)])
    stds = {f"init/{n}.weight/std": o for n, o in zip(names, own)}
    stds |= {reference_constant(f"{n}.weight", "init_std"): r for n, r in zip(names, ref)}
    constants = {reference_constant("features.0.weight", "grad_std"): 1e-30 * derived, **stds}
    params = {"module": "conv[0]"}
    check = {"metric": "grad_attenuation_over_derived", "op": "<=", "threshold": 1, "params": params}
    recs = records([2.3], modules=rows, constants=constants)
    assert observed(check, recs).observed == pytest.approx(1.0)
    assert observed(dict(check, params=dict(params, transform="abs_log2")), recs).ok
    four_times = {**constants, reference_constant("features.0.weight", "grad_std"): 4e-30 * derived}
    assert not observed(dict(check, params=dict(params, transform="abs_log2")),
                        records([2.3], modules=rows, constants=four_times)).ok
    unrecorded = {k: v for k, v in constants.items() if not k.startswith("init/")}  # an older run folder
    assert math.isnan(observed(check, records([2.3], modules=rows, constants=unrecorded)).observed)


@pytest.mark.parametrize("key, value, valid", [("transform", "log2", "abs_log2"), ("how", "diff", "abs_difference")])
def test_an_unknown_transform_or_how_is_one_line_naming_the_choices(key, value, valid):
    cfg = compose_config(["experiment=glorot_standard", "scale=tiny", f"+signature.checks.0.params.{key}={value}"])
    with pytest.raises(UserError, match=rf"params.{key}='{value}' is not valid; choose one of: .*{valid}"):
        validate(cfg)
