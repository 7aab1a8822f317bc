"""BatchNorm's two functions and the forgotten zero_grad: the mechanisms on tiny
models against hand-checked expectations, then the experiments' signatures, each against
its control (the opposite verdict)."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from conftest import compose_config
from torch import nn

from gradrepro.config.schema import ModePassConfig
from gradrepro.data import ImageData
from gradrepro.measure.frozen_audit import FrozenAudit
from gradrepro.measure.mode_pass import mode_pass
from gradrepro.objectives.classification import Classification, ClassificationConfig
from gradrepro.probe import Probe
from gradrepro.probe.config import ProbeConfig
from gradrepro.recipe.mode_policy import hold_eval
from gradrepro.records import read_run
from gradrepro.signature import evaluate, metric_ratio, observe
from gradrepro.signature.metrics.runs import curve_distance
from gradrepro.train.pipeline import run

# --- mechanisms on tiny models --------------------------------------------------------


def bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def tiny_data(n_test: int = 9) -> ImageData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 2, 2, generator=g)
    xt = torch.randn(n_test, 1, 2, 2, generator=g) + 0.5  # held-out, shifted a little
    return ImageData(x, torch.arange(16) % 3, xt, torch.arange(n_test) % 3, batch_size=8, views=False)


def trained_bn_net() -> nn.Sequential:
    net = bn_net()
    data = tiny_data()
    with torch.no_grad():  # move the running statistics away from their (0, 1) start
        for _ in range(5):
            net(data.x_train)
    return net


def test_eval_mode_diagnostic_is_the_deployed_function_with_gradients():
    net = trained_bn_net()
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    out = mode_pass(net, Classification(ClassificationConfig()), tiny_data(),
                    ModePassConfig(mode="eval", batch_size=4, small_batches=[2, 1]))
    assert out["diag_out_rel_diff"] == 0.0 and out["diag_loss_rel_diff"] == 0.0
    assert out["diag_buffers_identical"] == 1.0 and out["diag_running_mean_drift"] == 0.0
    assert out["diag_grad_present"] == 1.0  # eval mode is not no_grad
    assert out["diag_companion_diff"] == 0.0
    assert out["diag_raised_bs1"] == 0.0 and out["diag_out_rel_diff_bs1"] < 1e-6
    assert all(torch.equal(b, buffers[k]) for k, b in net.named_buffers())
    assert all(p.grad is None for p in net.parameters())  # .grad untouched


def test_train_mode_diagnostic_differs_moves_buffers_and_batch_of_one_is_a_result():
    net = trained_bn_net()
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    out = mode_pass(net, Classification(ClassificationConfig()), tiny_data(),
                    ModePassConfig(mode="train", batch_size=4, small_batches=[2, 1]))
    assert out["diag_out_rel_diff"] > 0 and out["diag_loss_rel_diff"] > 0
    assert out["diag_buffers_identical"] == 0.0 and out["diag_running_mean_drift"] > 0
    assert out["diag_grad_present"] == 1.0 and out["diag_grad_present_ref"] == 1.0
    assert out["diag_companion_diff"] > 0
    assert out["diag_raised_bs2"] == 0.0 and out["diag_out_rel_diff_bs2"] > out["diag_out_rel_diff"]
    assert out["diag_raised_bs1"] == 1.0 and "diag_out_rel_diff_bs1" not in out
    # The drift was measured, then undone; the network's modes are as they were.
    assert all(torch.equal(b, buffers[k]) for k, b in net.named_buffers())
    assert net.training


def test_frozen_bn_in_train_mode_changes_output_through_buffers_only():
    for hold in (False, True):
        net = bn_net()
        net[2].weight.requires_grad_(False)
        net[2].bias.requires_grad_(False)
        if hold:
            hold_eval(net, ["2"])
        audit = FrozenAudit(net, ["2.weight", "2.bias"], tiny_data().x_test)
        with torch.no_grad():
            net(tiny_data().x_train * 3 + 1)  # a training forward
        out = audit.finish(net)
        assert out["frozen_param_change"] == 0.0
        assert out["frozen_train_mode"] == (0.0 if hold else 1.0)
        assert (out["frozen_buffer_change"] > 0) != hold
        assert (out["frozen_output_change"] > 0.1) != hold


def sgd_steps(zero_grad: bool, steps: int = 4, lr: float = 0.1):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    probe = Probe(net, ProbeConfig(every=100, running_sum_steps=steps), total_steps=steps)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    x = torch.randn(8, 3)
    rows = []
    for step in range(steps):
        assert probe.logs(step)  # the running-sum window logs every step
        if zero_grad:
            opt.zero_grad(set_to_none=True)
        with probe.step(step, lr=lr) as p:
            loss = net(x + step).pow(2).mean()
            loss.backward()
            p.collect()
            opt.step()
        rows.append(p.columns)
    return rows


def test_probe_tells_the_running_sum_from_the_fresh_gradient():
    for step, cols in enumerate(sgd_steps(zero_grad=False)):
        assert cols["step_vs_running_sum"].max() < 1e-4
        if step > 0:
            assert cols["step_vs_fresh"].min() > 0.1
            assert (cols["grad_norm"] != cols["fresh_grad_norm"]).all()
    for step, cols in enumerate(sgd_steps(zero_grad=True)):
        assert cols["step_vs_fresh"].max() < 1e-4
        assert (cols["grad_norm"] == cols["fresh_grad_norm"]).all()
        if step > 0:
            assert cols["step_vs_running_sum"].min() > 0.1


# --- the experiments: each signature against its control --------------------------------


def run_quiet(tmp_path, name: str, *overrides: str):
    cfg = compose_config([f"experiment={name}", *overrides])
    with contextlib.redirect_stdout(io.StringIO()):
        summary = run(cfg, tmp_path / name)
    return cfg, summary, read_run(tmp_path / name).records()


def opposite(tmp_path, failure: str, control: str, *overrides: str, control_discriminates: bool = True):
    f_cfg, f_sum, f_rec = run_quiet(tmp_path, failure, *overrides)
    c_cfg, c_sum, c_rec = run_quiet(tmp_path, control, *overrides)
    assert f_sum["status"] == c_sum["status"] == "completed"
    assert f_sum["reproduced"], f_sum["checks"]
    assert c_sum["reproduced"], c_sum["checks"]
    # Each signature on the other run's records: the opposite verdict.
    assert not evaluate(f_cfg.signature, c_rec).reproduced
    if control_discriminates:
        assert not evaluate(c_cfg.signature, f_rec).reproduced
    return f_rec, c_rec


def test_dropout_left_on_reproduces_and_eval_mode_control_does_not(tmp_path):
    # The control's evidence is that the compared network learned, true of both runs; its
    # eval-against-eval checks are context there, and they fail on the left-on run's records.
    f_rec, _ = opposite(tmp_path, "dropout_left_on", "dropout_eval_mode", "train.steps=60",
                        control_discriminates=False)
    c_cfg = compose_config(["experiment=dropout_eval_mode"])
    context = evaluate(c_cfg.signature, f_rec).checks
    assert [c.ok for c in context if c.role == "context"] == [False, False]


def test_bn_diagnose_in_train_mode_reproduces_and_eval_mode_control_does_not(tmp_path):
    opposite(tmp_path, "bn_diagnose_in_train_mode", "bn_diagnose_in_eval_mode", "train.steps=100")


def test_bn_frozen_stats_moves_buffers_and_eval_mode_control_does_not(tmp_path):
    opposite(tmp_path, "bn_frozen_stats", "bn_frozen_eval_mode", "train.steps=30")


def test_forgotten_zero_grad_is_a_running_sum_and_tells_itself_from_an_lr_lookalike(tmp_path):
    forgotten, baseline = opposite(tmp_path, "zero_grad_forgotten", "zero_grad_baseline")
    l_cfg, l_sum, lookalike = run_quiet(tmp_path, "zero_grad_lr_lookalike")
    f_cfg = compose_config(["experiment=zero_grad_forgotten"])
    assert l_sum["reproduced"], l_sum["checks"]
    assert not evaluate(f_cfg.signature, lookalike).reproduced
    assert not evaluate(l_cfg.signature, forgotten).reproduced
    # Early window (the trial compared at step 50): the loss curve looks like the lookalike's.
    early = {"until_step": 50}
    assert curve_distance(forgotten, lookalike, **early) < curve_distance(forgotten, baseline, **early)
    # ...while every module's records tell them apart: accumulated vs fresh gradient norm.
    for rec, accumulates in ((forgotten, True), (lookalike, False)):
        m = rec.modules[rec.modules["step"] > 0]
        tensor = m["module"] + "." + m["param"]
        ratio = (m["grad_norm"] / m["fresh_grad_norm"]).groupby(tensor).median()
        assert ((ratio > 3) if accumulates else (ratio == 1)).all(), ratio


def test_bn_speedup_signature_fails_on_bn_none_within_the_same_budget(tmp_path):
    # A shortened run: BN reaches the target inside it, the BN-free network does not, so the
    # ratio (which needs both) is undefined and the verdict is not reproduced on either.
    b_cfg, b_sum, bn = run_quiet(tmp_path, "bn_speedup", "train.steps=120")
    _, _, none = run_quiet(tmp_path, "bn_none", "train.steps=120")
    params = {"column": "train_acc", "target": 0.99, "smooth": 3}
    assert math.isfinite(observe("steps_to", bn, 3, params)), b_sum["checks"]
    assert math.isnan(observe("steps_to", none, 3, params))
    assert not b_sum["reproduced"] and not evaluate(b_cfg.signature, none).reproduced


@pytest.mark.slow
def test_bn_speedup_reaches_the_target_in_fewer_steps_than_bn_none(tmp_path):
    bn, none = opposite(tmp_path, "bn_speedup", "bn_none")
    params = {"column": "train_acc", "target": 0.99, "smooth": 3}
    ratio = metric_ratio(none, bn, "steps_to", **params)
    assert math.isfinite(ratio) and ratio >= 3
