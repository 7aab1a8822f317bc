"""The probe's numbers against hand-computed values on a 2-layer model, and the gradient
states kept apart: none vs zero vs tiny vs non-finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradrepro.probe import FP16_FLUSH, Probe, grad_states
from gradrepro.probe.config import ProbeConfig


def two_layer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def probe_step(net, x, loss_fn, cfg=None, lr=0.1):
    probe = Probe(net, cfg or ProbeConfig(every=1, act_sample=1000), total_steps=1)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
    with probe.step(0, lr=lr) as p:
        loss = loss_fn(net(x))
        loss.backward()
        p.collect()
        opt.step()
    return p.columns


def test_norms_and_ratios_match_hand_computation():
    net = two_layer()
    x = torch.randn(5, 3)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    # Hand computation first, on a copy of the same network.
    ref = two_layer()
    ref(x).pow(2).sum().backward()
    cols = probe_step(net, x, lambda y: y.pow(2).sum(), lr=0.1)
    names = [f"{m}.{p}" for m, p in zip(cols["module"], cols["param"])]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for i, (name, p_ref) in enumerate(ref.named_parameters()):
        g = p_ref.grad
        assert cols["grad_norm"][i] == pytest.approx(g.norm().item(), rel=1e-5)
        assert cols["param_norm"][i] == pytest.approx(before[name].norm().item(), rel=1e-5)
        assert cols["grad_to_param"][i] == pytest.approx(g.norm().item() / before[name].norm().item(), rel=1e-5)
        # One SGD step of lr 0.1 moves the parameter by 0.1 * grad.
        assert cols["update_to_param"][i] == pytest.approx(0.1 * g.norm().item() / before[name].norm().item(), rel=1e-4)
        assert cols["grad_state"][i] == "finite"
        assert cols["frac_none"][i] == 0.0


def test_activation_statistics_match_module_outputs():
    net = two_layer()
    x = torch.randn(6, 3)
    h = net[0](x)
    out = net(x)
    cols = probe_step(net, x, lambda y: y.sum())
    first = list(cols["module"]).index("0")
    assert cols["act_mean"][first] == pytest.approx(h.mean().item(), rel=1e-5)
    assert cols["act_std"][first] == pytest.approx(h.std().item(), rel=1e-5)
    last = list(cols["module"]).index("2")
    assert cols["act_mean"][last] == pytest.approx(out.mean().item(), rel=1e-5)
    # d(sum)/d(out) is all ones: its std is zero.
    assert cols["act_grad_std"][last] == pytest.approx(0.0, abs=1e-7)


def test_none_zero_nonfinite_and_fp16_underflow_are_separate_states():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 1)
            self.unused = nn.Linear(2, 1)  # no path from the loss: none
            self.dead = nn.Linear(2, 1)  # multiplied by zero: exact zeros
            self.broken = nn.Linear(2, 1)  # multiplied by inf: non-finite
            self.small = nn.Linear(2, 1)  # gradients below fp16's smallest subnormal

        def forward(self, x):
            return (self.used(x) + 0.0 * self.dead(x) + float("inf") * self.broken(x)
                    + 1e-9 * self.small(x))

    torch.manual_seed(0)
    net = Net()
    cols = probe_step(net, torch.ones(4, 2), lambda y: y.sum(), cfg=ProbeConfig(every=1, tiny_factor=1e30))
    state = dict(zip([f"{m}.{p}" for m, p in zip(cols["module"], cols["param"])], cols["grad_state"]))
    assert state["unused.weight"] == "none" and state["unused.bias"] == "none"
    assert state["dead.weight"] == "zero" and state["dead.bias"] == "zero"
    assert state["broken.weight"] == "nonfinite"
    assert state["used.weight"] == "finite"
    idx = {f"{m}.{p}": i for i, (m, p) in enumerate(zip(cols["module"], cols["param"]))}
    assert cols["frac_none"][idx["unused.weight"]] == 1.0
    assert math.isnan(cols["grad_norm"][idx["unused.weight"]])
    assert cols["frac_zero"][idx["dead.weight"]] == 1.0
    assert cols["frac_nonfinite"][idx["broken.weight"]] == 1.0
    # 4 examples x 1e-9 = 4e-9 per entry: below 2^-25 (~3e-8), so all flush in fp16.
    assert cols["frac_fp16_underflow"][idx["small.weight"]] == 1.0
    assert cols["frac_fp16_underflow"][idx["used.weight"]] == 0.0


def test_fp16_flush_threshold_is_ieee_round_to_nearest():
    below = torch.tensor([FP16_FLUSH, FP16_FLUSH * 0.9], dtype=torch.float32)
    above = torch.tensor([FP16_FLUSH * 1.01, 2.0**-24], dtype=torch.float32)
    assert (below.half() == 0).all()
    assert (above.half() != 0).all()


def test_tiny_is_judged_against_the_median_not_the_maximum():
    has = np.ones(5, dtype=bool)
    ratios = np.array([1e-2, 1e-3, 1e-3, 1e-4, 1e-9])
    state = grad_states(has, np.zeros(5), np.ones(5), ratios, np.ones(5), tiny_factor=1e4)
    assert list(state) == ["finite", "finite", "finite", "finite", "tiny"]
    # The same spread without the outlier is healthy: no tiny.
    state = grad_states(has[:4], np.zeros(4), np.ones(4), ratios[:4], np.ones(4), tiny_factor=1e4)
    assert "tiny" not in list(state)


def test_probe_runs_nothing_on_unlogged_steps():
    net = two_layer()
    probe = Probe(net, ProbeConfig(every=4), total_steps=10)
    assert [s for s in range(10) if probe.logs(s)] == [0, 4, 8, 9]
    assert not probe.hooks.armed  # no hooks until armed
    with probe.step(1) as p:  # an unlogged step: nothing armed, nothing recorded
        assert not p.logged and not probe.hooks.armed
        net(torch.ones(1, 3)).sum().backward()
        p.collect()
    assert p.columns is None


def test_task_contribution_splits_gradient_by_loss_term():
    net = two_layer()
    x = torch.randn(5, 3)
    probe = Probe(net, ProbeConfig(every=1), total_steps=1)
    with probe.step(0) as p:
        y = net(x)
        terms = {"first": y[:, 0].sum(), "second": 0.0 * y[:, 1].sum()}
        (terms["first"] + terms["second"]).backward(retain_graph=True)
        p.contribution(terms)
        p.collect()
    cols = p.columns
    # The zero-weighted term sends nothing; the other term sends the whole gradient.
    np.testing.assert_allclose(cols["contrib_second"], 0.0, atol=1e-12)
    np.testing.assert_allclose(cols["contrib_first"], cols["grad_norm"], rtol=1e-5)


def _reference_columns(net, x, scale, grads=None, lr=0.1):
    """float64 references for one SGD step of ``net`` on ``scale * sum(out^2)``, with
    ``grads`` (name -> tensor) written over .grad after backward."""
    params = dict(net.named_parameters())
    before = {n: p.detach().double().clone() for n, p in params.items()}
    hidden = net[0](x)
    hidden.retain_grad()
    out = net[2](net[1](hidden))
    out.retain_grad()
    (out.pow(2).sum() * scale).backward()
    for name, g in (grads or {}).items():
        params[name].grad = g.clone()
    g64 = {n: p.grad.double() for n, p in params.items()}
    torch.optim.SGD(net.parameters(), lr=lr).step()
    # The update actually taken: lr * 1e-30 is below a float32 weight's precision, so there
    # the parameters do not move, and update_to_param must read 0, not lr * grad_to_param.
    moved = {n: (before[n] - p.detach().double()).norm().item() for n, p in params.items()}
    ref = {n: {"grad_norm": g.norm().item(), "grad_std": g.std().item(),
               "grad_to_param": g.norm().item() / before[n].norm().item(),
               "update_to_param": moved[n] / before[n].norm().item()}
           for n, g in g64.items()}
    act_grad = {"0": hidden.grad.double().std().item(), "2": out.grad.double().std().item()}
    return ref, act_grad


@pytest.mark.parametrize("case", ["tiny", "zero", "mixed", "subnormal"])
def test_norms_stds_and_ratios_hold_for_tiny_zero_and_mixed_gradients(case):
    # Entries of 1e-30 square to 1e-60, below float32's range: a plain float32 norm reads 0
    # there (on CPU and CUDA alike); the probe must read the float64 value.
    torch.manual_seed(0)
    x = torch.randn(6, 20)
    scale = {"tiny": 1e-30, "zero": 0.0, "mixed": 1.0, "subnormal": 1e-40}[case]
    grads = None
    if case == "mixed":  # one tensor spanning blocks: 1e-30 in the first block, ~1 after
        g = torch.randn(300, 20)
        g.view(-1)[:3000] *= 1e-30
        grads = {"0.weight": g}
    ref_net = nn.Sequential(nn.Linear(20, 300), nn.ReLU(), nn.Linear(300, 5))
    net = nn.Sequential(nn.Linear(20, 300), nn.ReLU(), nn.Linear(300, 5))
    net.load_state_dict(ref_net.state_dict())
    ref, act_grad = _reference_columns(ref_net, x, scale, grads)
    probe = Probe(net, ProbeConfig(every=1, act_sample=1000), total_steps=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with probe.step(0, lr=0.1) as p:
        (net(x).pow(2).sum() * scale).backward()
        for name, g in (grads or {}).items():
            dict(net.named_parameters())[name].grad = g.clone()
        p.collect()
        opt.step()
    cols = p.columns
    for i, (module, param) in enumerate(zip(cols["module"], cols["param"])):
        for column, expected in ref[f"{module}.{param}"].items():
            assert cols[column][i] == pytest.approx(expected, rel=1e-5, abs=0.0), (module, param, column)
        assert cols["act_grad_std"][i] == pytest.approx(act_grad[module], rel=1e-5, abs=0.0)
    if case in ("tiny", "subnormal"):
        assert (cols["grad_norm"] > 0).all() and (cols["grad_state"] == "finite").all()
    if case == "zero":
        assert (cols["grad_state"] == "zero").all() and (cols["grad_std"] == 0).all()


def test_layouts_follow_changing_batches_and_modules_seen_or_not():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.skip = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(4, 3)

        def forward(self, x, use_skip):
            return self.b(torch.relu(self.a(x))) + (self.skip(x) if use_skip else 0.0)

    torch.manual_seed(0)
    net = Net()
    probe = Probe(net, ProbeConfig(every=1, act_sample=5), total_steps=10)
    for step, (batch, use_skip) in enumerate([(7, True), (7, False), (3, False), (9, True)]):
        x = torch.randn(batch, 4)
        net.zero_grad()
        with probe.step(step) as p:
            hidden = net.a(x)
            out = net(x, use_skip)
            out.sum().backward()
            p.collect()
        cols = p.columns
        rows = {(m, q): i for i, (m, q) in enumerate(zip(cols["module"], cols["param"]))}
        assert cols["act_mean"][rows["a", "weight"]] == pytest.approx(hidden[:5].double().mean().item(), rel=1e-5)
        assert cols["act_std"][rows["a", "weight"]] == pytest.approx(hidden[:5].double().std().item(), rel=1e-5)
        assert cols["grad_norm"][rows["b", "weight"]] == pytest.approx(net.b.weight.grad.norm().item(), rel=1e-5)
        skip = rows["skip", "weight"]
        if use_skip:
            assert cols["act_mean"][skip] == pytest.approx(net.skip(x)[:5].double().mean().item(), rel=1e-5)
        else:  # not called this step: no activation statistics, no gradient
            assert np.isnan(cols["act_mean"][skip]) and cols["grad_state"][skip] == "none"


def test_a_value_cap_takes_as_many_whole_examples_as_fit_and_at_least_one():
    """``act_values``: of the ``act_sample`` first examples, the whole examples whose values fit
    under the cap (a (batch, 8) output: 16 values are 2 examples; a (batch, 40) output, wider
    than the cap, still gives its first example); 0 leaves the sample as it was."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 40)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    net, x = Net(), torch.randn(6, 4)
    for cap, take_a, take_b in ((16, 2, 1), (0, 5, 5), (1000, 5, 5)):
        probe = Probe(net, ProbeConfig(every=1, act_sample=5, act_values=cap), total_steps=1)
        net.zero_grad()
        with probe.step(0) as p:
            (net(x) ** 2).sum().backward()
            p.collect()
        cols = p.columns
        row = {m: i for i, (m, q) in enumerate(zip(cols["module"], cols["param"])) if q == "weight"}
        with torch.no_grad():
            hidden, out = net.a(x).double(), net(x).double()
        assert cols["act_std"][row["a"]] == pytest.approx(hidden[:take_a].std().item(), rel=1e-5)
        assert cols["act_std"][row["b"]] == pytest.approx(out[:take_b].std().item(), rel=1e-5)
        assert cols["act_grad_std"][row["b"]] == pytest.approx((2 * out[:take_b]).std().item(), rel=1e-5)
