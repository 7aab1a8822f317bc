"""Pure bf16 (precision.mode=bf16): stochastic rounding is unbiased against float64; round to
nearest keeps none of an update below half an ulp while stochastic rounding keeps it in
expectation and fp32 master weights keep it exactly; the measured share says so on a run; and
the bf16 experiments' verdicts, each against both its controls (slow)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from conftest import compose_config
from torch import nn

from gradrepro.errors import UserError
from gradrepro.measure.reference_runs import REFERENCE_MARK
from gradrepro.recipe.bf16 import BF16Weights, half_ulp_bf16, stochastic_round_to_bf16
from gradrepro.records import read_run
from gradrepro.records.run import RunRecords
from gradrepro.signature import METRICS, evaluate
from gradrepro.train.pipeline import run

torch.set_num_threads(1)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64: the bf16 values either side of fp32 ``x``: its mantissa cut to bf16's 7 bits
    (toward zero) and the next bf16 value away from zero (x itself where x is bf16 already)."""
    bits = x.numpy().view(np.uint32)
    toward = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    away = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    exact = toward == x.numpy().astype(np.float64)
    return torch.from_numpy(toward), torch.from_numpy(np.where(exact, toward, away))


def test_stochastic_rounding_is_unbiased_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.rand(64, generator=g) * 40 - 20) * torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)
    x[:4] = torch.tensor([0.0, 1.0, -0.75, 2.0**-130])  # exact in bf16 (a subnormal too): never moved
    lo, hi = bf16_neighbours(x)
    draws = torch.stack([stochastic_round_to_bf16(x, g).double() for _ in range(4000)])
    assert ((draws == lo) | (draws == hi)).all()  # always one of the two neighbours
    assert torch.equal(draws[:, :4], x[:4].double().expand(4000, 4))
    # Unbiased: E[round(x)] = x in float64, within 5 standard errors of the 4000 draws' mean.
    up = (x.double() - lo) / torch.where(hi != lo, hi - lo, torch.ones((), dtype=torch.float64))
    se = (hi - lo).abs() * torch.sqrt(up * (1 - up) / 4000)
    assert ((draws.mean(0) - x.double()).abs() <= 5 * se).all()
    assert ((draws == hi).double().mean(0)[4:] > 0).all()  # each inexact value rounded away sometimes
    assert torch.isnan(stochastic_round_to_bf16(torch.tensor([float("nan")]), g)).all()


def test_half_ulp_is_two_to_the_exponent_minus_eight():
    w = torch.tensor([1.0, 1.5, -3.0, 2.0**-10, 0.0])
    assert half_ulp_bf16(w).tolist() == [2.0**-8, 2.0**-8, 2.0**-7, 2.0**-18, 0.0]


def one_weight_run(rule: str, steps: int = 400, update: float = 2.0**-10):
    """A 1x64 linear layer with every weight 1.0 (half an ulp: 2^-8) and plain SGD stepping each
    by ``update`` (below half an ulp) in the same direction, ``steps`` times."""
    layer = nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    weights = BF16Weights(rule, layer, seed=0)
    opt = torch.optim.SGD(layer.parameters(), lr=update)
    for step in range(steps):
        layer.weight.grad = torch.full_like(layer.weight, -1.0)  # bf16, as backward would give
        if step == 0:
            weights.watch()
        weights.step(opt)
    return layer, weights, opt


def test_nearest_keeps_none_of_an_update_below_half_an_ulp():
    layer, weights, _ = one_weight_run("nearest")
    assert layer.weight.dtype == torch.bfloat16
    assert (layer.weight.float() == 1.0).all()  # 400 updates of 2^-10 each, none arrived
    small, mass, kept = weights.stats[id(layer.weight)][1:].tolist()
    assert small == 64 and mass == 64 * 2.0**-10 and kept == 0.0


def test_stochastic_rounding_keeps_it_in_expectation_and_master_weights_exactly():
    steps, update = 400, 2.0**-10
    layer, _, _ = one_weight_run("stochastic", steps, update)
    moved = layer.weight.double() - 1.0
    # Each step adds one ulp (2^-7) with probability 2^-10 / 2^-7: binomial, mean steps x update.
    p, ulp = update / 2.0**-7, 2.0**-7
    assert abs(moved.mean().item() - steps * update) < 4 * ulp * np.sqrt(steps * p * (1 - p) / 64)
    layer, weights, _ = one_weight_run("master", steps, update)
    assert (weights.master[0] == 1.0 + steps * update).all()  # fp32 adds 2^-10 exactly
    assert torch.equal(layer.weight, weights.master[0].to(torch.bfloat16))  # the bf16 copy: its rounding
    small, mass, kept = weights.stats[id(layer.weight)][1:].tolist()
    assert small == 64 and kept == mass


def test_pure_bf16_keeps_optimizer_state_in_bf16_and_master_in_fp32():
    for rule, bf16_state in (("nearest", True), ("stochastic", True), ("master", False)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        weights = BF16Weights(rule, net, seed=0)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(net(torch.randn(32, 8)).float(), torch.randint(0, 3, (32,))).backward()
            weights.step(opt)
        assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in net.parameters())
        moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
        representable = all(torch.equal(v, v.to(torch.bfloat16).float()) for v in moments)
        assert representable == bf16_state, rule


def kept_share(values: dict) -> float:
    import pandas as pd

    modules = pd.DataFrame({"step": 0, "module": "m", "param": ["weight"], **{k: [v] for k, v in values.items()}})
    return METRICS["bf16_update_kept"](RunRecords(pd.DataFrame({"step": [0]}), modules, {}), 1, reduce="min")


def test_kept_share_is_what_arrived_of_the_small_update_mass():
    assert kept_share({"bf16_update_kept_mass": 0.0, "bf16_update_small_mass": 2.0}) == 0.0
    assert kept_share({"bf16_update_kept_mass": 2.0, "bf16_update_small_mass": 2.0}) == 1.0
    assert np.isnan(kept_share({"bf16_update_kept_mass": 0.0, "bf16_update_small_mass": 0.0}))


def run_tiny(tmp_path, name: str) -> RunRecords:
    """``name`` at scale=tiny in this process, without its reference runs (none is read here)."""
    folder, overrides = tmp_path / name, [f"experiment={name}", "scale=tiny"]
    with contextlib.redirect_stdout(io.StringIO()):
        run(compose_config(overrides), folder, [*overrides, f"{REFERENCE_MARK}=test"])
    return read_run(folder).records()


def test_tiny_runs_record_what_each_rule_delivered(tmp_path):
    """The bf16 runs at scale=tiny: the weights are bf16, the probe counts the updates bf16 weights
    round away, and the kept share, pooled over every tensor, is 0 under nearest rounding, about
    1 under stochastic rounding, 1 with master weights (the failure's evidence holds on it and
    fails on both controls; the accuracy gap needs the default scale)."""
    shares = {}
    for name in ("bf16_nearest", "bf16_stochastic", "bf16_master"):
        records = run_tiny(tmp_path, name)
        assert records.modules["frac_bf16_update_lost"].between(0, 1).all()
        shares[name] = METRICS["bf16_update_kept"](records, 1, reduce="pooled")
        assert METRICS["bf16_update_small_share"](records, 1, reduce="pooled") > 0.5  # the regime, at init
    assert shares["bf16_nearest"] < 0.01
    assert 0.9 < shares["bf16_stochastic"] < 1.1
    assert shares["bf16_master"] == pytest.approx(1.0, abs=1e-6)
    fp32 = run_tiny(tmp_path, "bf16_fp32")
    assert fp32.modules["frac_bf16_update_lost"].isna().all()  # fp32 weights: not measured


def test_bf16_mode_takes_no_loss_scale_and_a_known_update_rule():
    from gradrepro.config.validate import validate

    with pytest.raises(UserError, match="precision.loss_scale=1.0"):
        validate(compose_config(["experiment=bf16_nearest", "precision.loss_scale=dynamic"]))
    with pytest.raises(UserError, match="nearest, stochastic, master"):
        validate(compose_config(["experiment=bf16_nearest", "precision.bf16_update=kahan"]))


# --- the verdicts at the default scale: each failure against both controls -------------------

@pytest.mark.slow
def test_bf16_verdicts_hold_and_nearest_evidence_fails_on_both_controls(tmp_path):
    seed = 7  # no knob was chosen on it
    records = {}
    for name in ("bf16_nearest", "bf16_stochastic", "bf16_master"):
        folder = tmp_path / name
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run(compose_config([f"experiment={name}", f"seed={seed}"]), folder,
                          [f"experiment={name}", f"seed={seed}"])
        assert summary["reproduced"], (name, summary["checks"])
        records[name] = read_run(folder).records()  # with its own fp32 reference
    failure = compose_config(["experiment=bf16_nearest"]).signature
    for control in ("bf16_stochastic", "bf16_master"):
        for check in evaluate(failure, records[control]).checks:
            if check.role == "evidence":
                assert not check.ok, (control, check)
    fix = compose_config(["experiment=bf16_stochastic"]).signature
    assert not any(c.ok for c in evaluate(fix, records["bf16_nearest"]).checks if c.role == "evidence")
