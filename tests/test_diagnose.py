"""gradrepro.diagnose on small models: every cause found on the parameter it concerns, every
detector silent on the repaired model, no false alarm on healthy shapes it was not designed
around, the model left as documented, bad input as one clear error."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import probe_step
from torch import nn

from gradrepro.diagnose import (
    DiagnoseError,
    check_derivative,
    diagnose,
)
from gradrepro.probe import Probe
from gradrepro.probe.config import ProbeConfig

torch.set_num_threads(1)


def batch(n: int = 16, d: int = 6, k: int = 3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


X, Y = batch()


def loss_of(model, x=X, y=Y):
    return lambda: F.cross_entropy(model(x), y)


class Net(nn.Module):
    """encoder -> tanh -> [body] -> head, with a switch per defect."""

    def __init__(self, defect: str = "", repaired: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.defect, self.repaired = defect, repaired
        self.encoder = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        broken = not repaired
        if defect == "list":  # nested: the plain list lives in a submodule
            self.body = nn.Module()
            layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh())]
            self.body.blocks = nn.ModuleList(layers) if repaired else layers
        elif defect == "dict":
            layers = {"a": nn.Linear(8, 8)}
            self.blocks = nn.ModuleDict(layers) if repaired else layers
        elif defect == "tuple":
            layers = (nn.Linear(8, 8),)
            self.blocks = nn.ModuleList(layers) if repaired else layers
        elif defect == "tensor":
            self.gain = nn.Parameter(torch.ones(8)) if repaired else torch.ones(8, requires_grad=True)
        elif defect == "unused":
            self.aux = nn.Linear(8, 3)
        elif defect == "tiny":
            self.mid = nn.Linear(8, 8)
        self.broken = broken

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        d, broken = self.defect, self.broken
        if d == "detach" and broken:
            h = h.detach()
        elif d == "no_grad" and broken:
            with torch.no_grad():
                h = torch.tanh(self.encoder(x))
        elif d == "rebuild" and broken:
            h = torch.tensor(h.tolist())
        elif d == "list":
            for block in self.body.blocks:
                h = block(h)
        elif d in ("dict", "tuple"):
            for block in (self.blocks.values() if isinstance(self.blocks, (dict, nn.ModuleDict)) else self.blocks):
                h = torch.tanh(block(h))
        elif d == "tensor":
            h = h * self.gain
        elif d == "zero" and broken:
            h = h * 0.0  # the encoder's gradient is exactly zero
        elif d == "nan" and broken:
            h = h + 0.0 * torch.sqrt(self.encoder.weight.sum() * 0.0 - 1.0)  # NaN reaches the gradient
        elif d == "tiny":
            h = torch.tanh(self.mid(h * (1e-5 if broken else 1.0)))
        out = self.head(h)
        if d == "underflow" and broken:
            out = out * 1e-9  # every gradient ~1e-9: below fp16's 2^-24 flush threshold
        if d == "unused" and not broken:
            out = out + self.aux(h)
        elif d == "unused":
            self.aux(h)  # computed, never used by the loss
        return out


def sgd(model, **kw):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kw)


def kinds(report):
    return {(f.kind, f.name) for f in report.findings}


def train_steps(model, opt, n=3, zero_grad=True):
    for _ in range(n):
        if zero_grad:
            opt.zero_grad()
        loss_of(model)().backward()
        opt.step()


# --- each cause: found where it is, and gone when repaired ------------------------------------

CAUSES = {
    # name: (defect, expected (kind, name) pairs)
    "unregistered_list_nested": ("list", {("unregistered", "body.blocks[0]")}),
    "unregistered_dict": ("dict", {("unregistered", "blocks['a']")}),
    "unregistered_tuple": ("tuple", {("unregistered", "blocks[0]")}),
    "tensor_attribute": ("tensor", {("unregistered", "gain")}),
    "detached": ("detach", {("no_gradient", "encoder.weight"), ("no_gradient", "encoder.bias")}),
    "no_grad": ("no_grad", {("no_gradient", "encoder.weight"), ("no_gradient", "encoder.bias")}),
    "tensor_rebuild": ("rebuild", {("no_gradient", "encoder.weight"), ("no_gradient", "encoder.bias")}),
    "unused_branch": ("unused", {("no_gradient", "aux.weight"), ("no_gradient", "aux.bias")}),
    # h * 0: the encoder gets zeros, and so does the head's weight (its input is zero).
    "zero_gradient": ("zero", {("zero_gradient", n) for n in ("encoder.weight", "encoder.bias", "head.weight")}),
    # h * 1e-5: the encoder's gradient is attenuated, and so is mid's weight (its input is small).
    "tiny_gradient": ("tiny", {("tiny_gradient", n) for n in ("encoder.weight", "encoder.bias", "mid.weight")}),
}


def optimizer_for(defect, model):
    # Adam's step does not scale with the gradient, so gradients of 1e-9 still move the weights.
    return torch.optim.Adam(model.parameters(), lr=1e-2) if defect == "underflow" else sgd(model)


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_cause_is_found_on_its_parameter_and_repair_clears_it(cause):
    defect, expected = CAUSES[cause]
    broken = Net(defect)
    report = diagnose(broken, optimizer_for(defect, broken), loss_of(broken))
    assert expected <= kinds(report), str(report)
    flagged = {(f.kind, f.name) for f in report.flagged()}
    assert flagged == expected, str(report)
    repaired = Net(defect, repaired=True)
    fixed = diagnose(repaired, optimizer_for(defect, repaired), loss_of(repaired))
    assert not fixed.flagged(), str(fixed)
    assert not {k for k, _ in expected} & {k for k, _ in kinds(fixed)}


def test_severed_and_unused_paths_are_told_apart():
    detached, unused = Net("detach"), Net("unused")
    rd = diagnose(detached, sgd(detached), loss_of(detached))
    ru = diagnose(unused, sgd(unused), loss_of(unused))
    assert rd.table.set_index("name").loc["encoder.weight", "loss_depends"] == 1.0
    assert ru.table.set_index("name").loc["aux.weight", "loss_depends"] == 0.0
    assert check_derivative(loss_of(detached), detached.encoder.weight) == pytest.approx(1.0)
    assert check_derivative(loss_of(unused), unused.aux.weight) == 0.0


def test_nonfinite_gradient():
    net = Net("nan")
    report = diagnose(net, sgd(net), loss_of(net), step=False)
    assert ("nonfinite_gradient", "encoder.weight") in kinds(report)
    repaired = Net("nan", repaired=True)
    assert "nonfinite_gradient" not in {f.kind for f in diagnose(repaired, sgd(repaired), loss_of(repaired)).findings}


def test_stale_optimizer_after_module_replacement():
    net = Net()
    opt = sgd(net)
    net.head = nn.Linear(8, 3)  # replaced after the optimizer was built
    report = diagnose(net, opt, loss_of(net))
    assert {("not_in_optimizer", "head.weight"), ("not_in_optimizer", "head.bias"),
            ("stale_optimizer_param", "param_groups.0.params.2"),
            ("stale_optimizer_param", "param_groups.0.params.3")} == {(f.kind, f.name) for f in report.flagged()}
    assert "head.weight" in report.findings[0].detail  # names the likely replaced tensor
    fixed = Net()
    fixed.head = nn.Linear(8, 3)  # replaced before: the repair
    assert diagnose(fixed, sgd(fixed), loss_of(fixed)).ok


def test_not_in_optimizer_with_param_groups_by_identity():
    net = Net()
    opt = torch.optim.SGD([{"params": [net.encoder.weight], "lr": 0.1},
                           {"params": [net.head.weight, net.head.bias], "lr": 0.01}])
    report = diagnose(net, opt, loss_of(net))
    assert {(f.kind, f.name) for f in report.flagged()} == {("not_in_optimizer", "encoder.bias")}
    # A same-shaped copy is not membership: identity, not name or value. One copied tensor among
    # the model's own is a partial mismatch, named per tensor (all copies: tests/test_diagnose_inputs.py).
    copied = net.encoder.weight.detach().clone().requires_grad_()
    opt2 = torch.optim.SGD([copied, net.encoder.bias, net.head.weight, net.head.bias], lr=0.1)
    report2 = diagnose(net, opt2, loss_of(net))
    assert {(f.kind, f.name) for f in report2.flagged()} == {("not_in_optimizer", "encoder.weight"),
                                                             ("stale_optimizer_param", "param_groups.0.params.0")}


def test_frozen_is_information_and_frozen_in_optimizer_is_named():
    net = Net()
    net.encoder.requires_grad_(False)
    report = diagnose(net, sgd(net), loss_of(net))  # built after freezing: still holds the frozen tensors
    assert report.ok and not report.flagged()
    assert ("frozen_in_optimizer", "encoder.weight") in kinds(report)
    net2 = Net()
    net2.encoder.requires_grad_(False)
    opt = torch.optim.SGD([p for p in net2.parameters() if p.requires_grad], lr=0.1)
    report2 = diagnose(net2, opt, loss_of(net2))
    assert report2.ok and ("frozen", "encoder.weight") in kinds(report2)
    assert not report2.table.set_index("name").loc["encoder.weight", "changed"]
    unfrozen = Net()
    assert not {"frozen", "frozen_in_optimizer"} & {f.kind for f in diagnose(unfrozen, sgd(unfrozen),
                                                                           loss_of(unfrozen)).findings}


def test_forgotten_zero_grad_is_stale_and_zeroing_loop_is_not():
    broken, healthy = Net(), Net()
    opt_b, opt_h = sgd(broken), sgd(healthy)
    train_steps(broken, opt_b, n=5, zero_grad=False)
    train_steps(healthy, opt_h, n=5, zero_grad=True)  # leaves the last step's gradient behind
    rb = diagnose(broken, opt_b, loss_of(broken))
    rh = diagnose(healthy, opt_h, loss_of(healthy))
    assert {n for k, n in kinds(rb) if k == "stale_gradient"} == {"encoder.weight", "encoder.bias",
                                                                 "head.weight", "head.bias"}
    assert not rh.flagged() and "leftover_gradient" in {f.kind for f in rh.findings}


def test_a_zeroing_loop_whose_last_gradient_was_large_leaves_no_stale_gradient():
    # The last step's loss is scaled up, so what it leaves in .grad is many times a fresh
    # gradient: still one backward's gradient, which a loop that zeroes every step leaves.
    net = Net()
    opt = sgd(net)
    for scale in (1.0, 1.0, 10.0):
        opt.zero_grad()
        (scale * loss_of(net)()).backward()
        opt.step()
    report = diagnose(net, opt, loss_of(net))
    assert not report.flagged(), str(report)
    (note,) = [f for f in report.findings if f.kind == "leftover_gradient"]
    assert "one backward pass alone" in note.detail


class IndexedTable(nn.Module):
    """A bias table read by index, one entry twice: the index's backward sums into its buffer in
    place, so the table's .grad is at version 1 after a single backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.table = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.head(h) + self.table[torch.tensor([0, 1, 1])]


def test_a_tensor_whose_one_backward_sums_in_place_is_not_stale_in_a_zeroing_loop():
    for zero_grad in (True, False):
        net = IndexedTable()
        opt = sgd(net)
        for scale in (1.0, 1.0, 10.0):  # the last gradient is many times a fresh one
            if zero_grad:
                opt.zero_grad()
            (scale * loss_of(net)()).backward()
            opt.step()
        assert net.table.grad._version > 0
        report = diagnose(net, opt, loss_of(net))
        stale = {f.name for f in report.findings if f.kind == "stale_gradient"}
        if zero_grad:
            assert not report.flagged(), str(report)
            assert "leftover_gradient" in {f.kind for f in report.findings}, str(report)
        else:
            assert stale == {n for n, _ in net.named_parameters()}, str(report)


def test_no_graph_under_no_grad_and_inference_mode():
    net = Net()
    for context in (torch.no_grad, torch.inference_mode):
        def closure(context=context):
            with context():
                return F.cross_entropy(net(X), Y)

        report = diagnose(net, sgd(net), closure)
        assert [f.kind for f in report.flagged()] == ["no_graph"]
        assert not report.stepped
    assert "no_graph" not in {f.kind for f in diagnose(net, sgd(net), loss_of(net)).findings}


def test_not_updated_and_update_mismatch_from_step_hooks():
    net = Net()
    opt = sgd(net)
    handle = opt.register_step_pre_hook(lambda o, a, k: setattr(net.head.bias, "grad", None))
    report = diagnose(net, opt, loss_of(net))
    assert ("not_updated", "head.bias") in {(f.kind, f.name) for f in report.flagged()}
    handle.remove()

    def nudge(o, a, k):
        with torch.no_grad():
            net.head.weight.mul_(1.01)

    handle = opt.register_step_post_hook(nudge)
    report = diagnose(net, opt, loss_of(net))
    assert {(f.kind, f.name) for f in report.flagged()} == {("update_mismatch", "head.weight")}
    handle.remove()
    assert not diagnose(net, opt, loss_of(net)).flagged()


def test_update_below_float32_resolution_is_rounding_said_as_information():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-12)
    report = diagnose(net, opt, loss_of(net))
    assert not report.flagged(), str(report)
    notes = [f for f in report.findings if f.kind == "not_updated"]
    assert notes and all(f.severity == "info" and "rounding, not a bug" in f.detail for f in notes)


def test_zero_learning_rate_in_one_group_is_information_and_in_every_group_a_warning():
    net = Net()
    opt = torch.optim.SGD([{"params": net.encoder.parameters(), "lr": 0.0},
                           {"params": net.head.parameters(), "lr": 0.1}])
    report = diagnose(net, opt, loss_of(net))
    assert report.ok and not report.flagged(), str(report)
    assert {(f.kind, f.severity) for f in report.findings if f.name.startswith("encoder")} == {("not_updated", "info")}
    frozen_by_lr = Net()
    report = diagnose(frozen_by_lr, torch.optim.SGD(frozen_by_lr.parameters(), lr=0.0), loss_of(frozen_by_lr))
    assert {(f.kind, f.severity) for f in report.flagged()} == {("not_updated", "warning")}


class Gain(nn.Module):
    """A float32 gain after a linear layer: under float16 autocast the linear layer runs in
    float16 and the gain's product in float32 (type promotion)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.gain = nn.Linear(6, 3), nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.linear(x) * self.gain


def test_fp16_underflow_only_where_the_gradient_is_in_float16():
    # Every gradient ~1e-9, below float16's 2^-24: in float32 that flushes nothing, so no finding.
    model = Gain()
    loss = lambda: (model(X) * 1e-9).square().sum()  # noqa: E731
    fp32 = diagnose(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss)
    assert "fp16_underflow" not in {f.kind for f in fp32.findings}, str(fp32)

    def under_fp16_autocast():
        with torch.autocast("cpu", dtype=torch.float16):
            return loss()

    fp16 = diagnose(model, torch.optim.Adam(model.parameters(), lr=1e-2), under_fp16_autocast)
    assert ("fp16_underflow", "gain") in {(f.kind, f.name) for f in fp16.flagged()}, str(fp16)


# --- healthy shapes: no false alarms, and the update rule checked ------------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 6)
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 5, bias=False)
        self.out.weight = self.embed.weight  # used twice

    def forward(self, idx):
        return self.out(torch.tanh(self.proj(self.embed(idx))))


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before batch norm: it would be cancelled (see test_bias_before_batchnorm...).
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8, bias=False)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 3)})
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(8))])
        self.register_buffer("offset", torch.zeros(6))
        self.norm = nn.BatchNorm1d(8)
        self.cache = [self.layers[0]]  # a plain-list alias of a registered layer: not a defect

    def forward(self, x):
        h = torch.tanh(self.layers[0](x - self.offset))
        h = torch.tanh(self.norm(self.layers[1](h))) * self.scales[0]
        self.hidden = h  # a non-leaf intermediate kept for inspection
        return self.heads["a"](h)


def nested():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Linear(8, 3))


HEALTHY = {
    "nested_sgd_nesterov_wd": lambda: (nested(), lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3), 3),
    "nested_sgd_dampening_maximize": lambda: (nested(), lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.5, dampening=0.3, maximize=True), 2),
    "containers_adam_state": lambda: (Containers(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 3),
    "containers_adam_amsgrad_l2": lambda: (Containers(), lambda m: torch.optim.Adam(
        m.parameters(), lr=1e-2, amsgrad=True, weight_decay=1e-2), 2),
    "groups_adamw_different_lrs": lambda: (nested(), lambda m: torch.optim.AdamW(
        [{"params": m[0].parameters(), "lr": 1e-2}, {"params": list(m[1].parameters()) + list(m[2].parameters()),
                                                      "lr": 1e-3, "weight_decay": 0.1}]), 3),
}


@pytest.mark.parametrize("shape", sorted(HEALTHY))
def test_healthy_shapes_raise_no_flag_and_match_the_rule(shape):
    model, make_opt, warm = HEALTHY[shape]()
    opt = make_opt(model)
    train_steps(model, opt, n=warm)  # optimizer state (momentum, Adam moments) is not empty
    report = diagnose(model, opt, loss_of(model))
    assert report.ok and not report.flagged(), str(report)
    stepped = report.table[report.table["in_optimizer"]]
    assert stepped["changed"].all() and (stepped["update_ok"] == 1).all()
    assert (stepped["update_rel_err"] < 1e-3).all()


def test_bias_before_batchnorm_is_named_redundant_as_information():
    # BN subtracts the batch mean, so a bias just before it has no effect: its gradient is zero
    # up to rounding. diagnose names the structure and says the bias is redundant.
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_of(model))
    assert report.ok and not report.flagged(), str(report)
    (note,) = [f for f in report.findings if f.kind == "redundant_parameter"]
    assert note.name == "0.bias" and note.severity == "info"
    assert "batch normalisation" in note.detail and "redundant" in note.detail


def test_tied_weight_is_one_row_and_no_alarm():
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([0, 1, 2, 3, 4, 1])
    report = diagnose(model, opt, lambda: F.cross_entropy(model(idx), torch.tensor([1, 2, 3, 4, 0, 2])))
    assert not report.flagged(), str(report)
    row = report.table.set_index("name").loc["embed.weight"]
    assert row["aliases"] == "out.weight" and row["update_ok"] == 1


def test_eval_mode_and_nonleaf_are_information():
    model = Containers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    report = diagnose(model, opt, loss_of(model))
    assert report.ok and not report.flagged(), str(report)
    assert {"eval_mode", "nonleaf_grad"} <= {f.kind for f in report.findings}
    assert "retain_grad" in next(f.detail for f in report.findings if f.kind == "nonleaf_grad")
    model.train()
    assert "eval_mode" not in {f.kind for f in diagnose(model, opt, loss_of(model)).findings}


def test_grad_states_agree_with_the_probe():
    net = Net("tiny")
    probe = Probe(net, ProbeConfig(every=1, activations=False, task_contribution=False), total_steps=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    report = diagnose(net, opt, loss_of(net), step=False)
    opt.zero_grad()
    cols = probe_step(probe, loss_of(net))
    assert list(report.table["grad_state"]) == list(cols["grad_state"])
    assert "tiny" in set(cols["grad_state"])


# --- what diagnose changes ---------------------------------------------------------------------

def test_step_false_changes_nothing_and_step_true_exactly_one_step():
    model = Containers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, n=2, zero_grad=True)
    del model.hidden  # a non-leaf intermediate cannot be deep-copied
    twin, twin_opt = copy.deepcopy((model, opt))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    bufs = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    report = diagnose(model, opt, loss_of(model), step=False)
    assert not report.stepped
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and torch.equal(p.grad, grads[n])
        assert torch.equal(opt.state[p]["momentum_buffer"], bufs[n])
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n])
    assert model.training

    report = diagnose(model, opt, loss_of(model))
    twin_opt.zero_grad()
    loss_of(twin)().backward()
    twin_opt.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), n
        assert torch.equal(p.grad, grads[n])  # the gradients are put back as they were
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n])


# --- check_derivative ------------------------------------------------------------------------

def test_check_derivative_matches_autograd_in_float64_on_a_float32_model():
    model = Containers()
    closure = loss_of(model)
    weight = model.layers[0].weight
    assert check_derivative(closure, weight, model=model) < 1e-6
    assert check_derivative(closure, weight, index=[(0, 1), 5], model=model) < 1e-6
    assert check_derivative(closure, model.scales[0], index=3, model=model) < 1e-6
    # Without the float64 promotion the float32 rounding dominates: the promotion matters.
    assert check_derivative(closure, weight, model=model, float64=False) > 1e-4


def test_check_derivative_restores_frozen_flag_values_and_buffers():
    model = Containers()
    model.layers[0].requires_grad_(False)
    before = model.layers[0].weight.detach().clone()
    stats = model.norm.running_mean.clone()
    assert check_derivative(loss_of(model), model.layers[0].weight, model=model) < 1e-6
    assert not model.layers[0].weight.requires_grad
    assert torch.equal(model.layers[0].weight, before)
    assert torch.equal(model.norm.running_mean, stats)


# --- bad input ---------------------------------------------------------------------------------

def _bad_inputs():
    net = Net()
    opt = sgd(net)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    frozen_loss = F.cross_entropy(net(X), Y)
    frozen_loss.backward()  # its graph is freed
    return {
        "non_scalar": (net, opt, lambda: F.cross_entropy(net(X), Y, reduction="none"), ValueError, "shape"),
        "tuple": (net, opt, lambda: (F.cross_entropy(net(X), Y), 1), TypeError, "tuple"),
        "python_float": (net, opt, lambda: F.cross_entropy(net(X), Y).item(), TypeError, ".item()"),
        "not_an_optimizer": (net, sched, loss_of(net), TypeError, "torch.optim.Optimizer"),
        "param_list_as_optimizer": (net, list(net.parameters()), loss_of(net), TypeError, "Optimizer"),
        "model_without_parameters": (nn.ReLU(), opt, loss_of(net), ValueError, "no registered parameters"),
        "not_a_module": (object(), opt, loss_of(net), TypeError, "nn.Module"),
        "closure_runs_backward": (net, opt, lambda: _backward_inside(net), ValueError, "backward"),
        "freed_graph": (net, opt, lambda: frozen_loss, ValueError, "fresh loss"),
        "not_callable": (net, opt, 3.0, TypeError, "callable"),
    }


def _backward_inside(net):
    loss = F.cross_entropy(net(X), Y)
    loss.backward()
    return loss


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_bad_input_is_one_clear_error(case):
    model, opt, closure, exc_type, words = _bad_inputs()[case]
    with pytest.raises(DiagnoseError) as info:
        diagnose(model, opt, closure)
    assert isinstance(info.value, exc_type)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_bad_input_leaves_gradients_as_they_were():
    net = Net()
    opt = sgd(net)
    loss_of(net)().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(DiagnoseError):
        diagnose(net, opt, lambda: (1, 2))
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))


def test_check_derivative_bad_input():
    net = Net()
    with pytest.raises(DiagnoseError):
        check_derivative(loss_of(net), net.encoder.weight * 2)  # not a leaf
    with pytest.raises(DiagnoseError):
        check_derivative(loss_of(net), net.encoder.weight, index=(9, 9))
    with pytest.raises(DiagnoseError):
        check_derivative(lambda: net(X), net.encoder.weight)  # non-scalar
    assert math.isfinite(check_derivative(loss_of(net), net.encoder.bias))
