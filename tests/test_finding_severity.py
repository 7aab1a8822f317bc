"""Severity from evidence (``gradrepro.diagnose.severity``): patterns healthy models show are
information until they persist, gradients zero by the architecture's algebra are named
redundant, and contradictions stay loud."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.diagnose import diagnose
from gradrepro.diagnose.severity import PERSIST_STEPS

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(16, 6, generator=G), torch.randint(0, 3, (16,), generator=G)
TOKENS = torch.randn(4, 5, 8, generator=G)


def ce(model, x=X, y=Y):
    return lambda: F.cross_entropy(model(x), y)


class Attention(nn.Module):
    """One softmax attention with separate query, key and value projections (biases on all)."""

    def __init__(self, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):  # BxTxD -> B x 3
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5
        return self.out(scores.softmax(-1) @ self.v(x)).mean(1)[:, :3]


def test_key_bias_under_softmax_is_named_redundant_and_query_bias_is_not():
    model = Attention()
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(1))
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, TOKENS, y))
    assert not report.flagged(), str(report)
    redundant = {f.name: f for f in report.findings if f.kind == "redundant_parameter"}
    assert set(redundant) == {"k.bias"}, str(report)
    assert "softmax" in redundant["k.bias"].detail and redundant["k.bias"].severity == "info"


class LayerScaleBlock(nn.Module):
    """x + gamma * mlp(x), gamma initialised at 1e-5 (Touvron et al. 2021, CaiT, Sec. 3)."""

    def __init__(self, dim=8, init=1e-5):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mlp, self.head = nn.Linear(6, dim), nn.Linear(dim, dim), nn.Linear(dim, 3)
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(h + self.gamma * torch.tanh(self.mlp(h)))


def test_layer_small_by_design_is_information_naming_its_gain():
    model = LayerScaleBlock()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert not report.flagged(), str(report)
    tiny = [f for f in report.findings if f.kind == "tiny_gradient"]
    assert tiny and all(f.severity == "info" and "gamma" in f.detail for f in tiny), str(report)


class DropPath(nn.Module):
    """A residual branch kept with probability 1 - p for the whole batch (stochastic depth,
    Huang et al. 2016), rescaled when kept."""

    def __init__(self, p=0.5):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.branch, self.head, self.p = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3), p

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        keep = (torch.rand(()) >= self.p).float() / (1 - self.p)
        return self.head(h + keep * torch.tanh(self.branch(h)))


def test_a_block_dropped_by_stochastic_depth_is_information():
    model = DropPath()
    dropped = next(seed for seed in range(100) if torch.rand((), generator=torch.Generator().manual_seed(seed))
                   < model.p)  # a seed whose first draw drops the branch, for the diagnostic step
    torch.manual_seed(dropped)
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    zero = [f for f in report.findings if f.kind == "zero_gradient"]
    assert {f.name for f in zero} == {"branch.weight", "branch.bias"}, str(report)
    assert all(f.severity == "info" and "another random seed" in f.detail for f in zero)
    assert not report.flagged(), str(report)


def _loop(tmp_path, model, steps, every=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logging.getLogger("gradrepro.watch.watcher").setLevel(logging.ERROR)
    with gradrepro.record(model, opt, tmp_path / "run", every=every, on_finding="log") as rec:
        for _ in range(steps):
            opt.zero_grad()
            ce(model)().backward()
            opt.step()
    return rec


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.aux = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.used(x)  # aux: an auxiliary head the loss leaves out


def test_live_unused_branch_is_information_then_a_warning_once_it_persists(tmp_path):
    rec = _loop(tmp_path, Unused(), PERSIST_STEPS + 1)
    found = [(f.kind, f.name, f.severity, f.step) for f in rec.watch.found if f.name == "aux.weight"]
    assert found == [("no_gradient", "aux.weight", "info", 0),
                     ("no_gradient", "aux.weight", "warning", PERSIST_STEPS - 1)], found
    warning = next(f for f in rec.watch.found if f.severity == "warning")
    assert "find_unused_parameters" in warning.detail


def test_live_unused_branch_for_fewer_steps_than_the_persistence_stays_information(tmp_path):
    rec = _loop(tmp_path, Unused(), PERSIST_STEPS - 1)
    assert not [f for f in rec.findings() if f.severity != "info"], rec.findings()


class NaNLoss(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.linear(x)) * torch.tensor(float("nan"))


def test_live_nonfinite_gradient_counts_entries_not_a_fraction(tmp_path):
    rec = _loop(tmp_path, NaNLoss(), 1)
    found = {f.name: f for f in rec.watch.found if f.kind == "nonfinite_gradient"}
    assert "48 of its 48 gradient entries (100.0%)" in found["linear.weight"].detail, found


def _lr_zero_findings(tmp_path, groups_at_zero):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    logging.getLogger("gradrepro.watch.watcher").setLevel(logging.ERROR)
    with gradrepro.record(model, opt, tmp_path / f"run{len(groups_at_zero)}", every=1, on_finding="log") as rec:
        for step in range(3):
            if step == 1:  # not at step 0, where a warm-up from lr 0 starts by design
                for g in groups_at_zero:
                    opt.param_groups[g]["lr"] = 0.0
            opt.zero_grad()
            ce(model)().backward()
            opt.step()
    return {(f.name, f.severity) for f in rec.watch.found if f.kind == "lr_zero"}


def test_live_lr_zero_in_one_group_is_information_and_in_every_group_a_warning(tmp_path):
    assert _lr_zero_findings(tmp_path, [0]) == {("0.weight", "info")}
    assert {s for _, s in _lr_zero_findings(tmp_path, [0, 1])} == {"warning"}


class TwoLevelHead(nn.Module):
    """A detector's regression head at two levels, its loss read at the anchors a box matched
    (an index computed from the data, as torchvision's SSD and RetinaNet losses do)."""

    def __init__(self, broken=False):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.level_a, self.level_b = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.broken = broken

    def forward(self, x, matched):  # matched: B x 8 anchors (4 per level), True where a box matched
        h = torch.tanh(self.trunk(x))
        b = self.level_b(h) * (0.0 if self.broken else 1.0)  # broken: a zero made before the selection
        boxes = torch.cat([self.level_a(h), b], 1)  # B x 8
        return (boxes[matched] - 1.0).pow(2).mean()


def test_a_level_no_anchor_matched_is_information_and_a_zero_made_before_the_selection_is_not():
    matched = torch.zeros(16, 8, dtype=torch.bool)
    matched[:, 0] = True  # on this batch only level a's first anchor matched
    model = TwoLevelHead()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda: model(X, matched))
    zero = {f.name: f for f in report.findings if f.kind == "zero_gradient"}
    assert set(zero) == {"level_b.weight", "level_b.bias"} and not report.flagged(), str(report)
    assert all(f.severity == "info" and "x[idx] or x[mask]" in f.detail for f in zero.values())
    matched[:, 6] = True  # a batch that matches level b too: no zero at all
    assert not [f for f in diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    lambda: model(X, matched)).findings if f.kind == "zero_gradient"]
    broken = TwoLevelHead(broken=True)  # level b matched, but its output multiplied by 0 before the index
    report = diagnose(broken, torch.optim.SGD(broken.parameters(), lr=0.1), lambda: broken(X, matched))
    assert {(f.kind, f.name, f.severity) for f in report.flagged()} == {
        ("zero_gradient", "level_b.weight", "warning"), ("zero_gradient", "level_b.bias", "warning")}, str(report)



class ReluRegression(nn.Module):
    """A regression head with a ReLU on its outputs (as FCOS's), its loss read at the positions a
    box matched through a comparison of the predictions (the overlap test of a GIoU loss, a
    recorded cut on a side path). ``rounded``: the predictions rounded before the loss, a step
    function whose derivative is zero at every entry, a bug."""

    def __init__(self, rounded=False):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.reg = nn.Linear(6, 8), nn.Linear(8, 4)
        self.rounded = rounded

    def predict(self, x):
        pred = torch.relu(self.reg(torch.tanh(self.trunk(x))))  # B x 4
        return pred.round() if self.rounded else pred

    def forward(self, x, matched):
        chosen = self.predict(x)[matched]
        overlap = chosen > 0.5  # no gradient through the mask, which the cut recorder sees
        return (torch.where(overlap, chosen, 2 * chosen) - 1.0).pow(2).mean()


def test_a_zero_the_matched_positions_make_through_a_relu_is_information_despite_a_cut_and_a_rounding_is_not():
    model = ReluRegression()
    with torch.no_grad():  # this batch matched only positions where the ReLU is off
        matched = model.reg(torch.tanh(model.trunk(X))) <= 0
    assert matched.any() and not matched.all()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda: model(X, matched))
    zero = {f.name: f for f in report.findings if f.kind == "zero_gradient"}
    assert set(zero) == {"trunk.weight", "trunk.bias", "reg.weight", "reg.bias"} and not report.flagged(), \
        str(report)
    assert all(f.severity == "info" for f in zero.values())
    broken = ReluRegression(rounded=True)
    report = diagnose(broken, torch.optim.SGD(broken.parameters(), lr=0.1), lambda: broken(X, ~matched))
    assert {(f.kind, f.name, f.severity) for f in report.flagged()} == {
        ("zero_gradient", n, "warning") for n in ("trunk.weight", "trunk.bias", "reg.weight", "reg.bias")}, \
        str(report)

class GainBeforeNorm(nn.Module):
    """A batch-norm gain whose output a ReLU, a per-feature scale and a second (train-mode)
    normalisation follow, as in timm's LCNetV2 (pointwise conv, BN, ReLU; the next block's
    depthwise conv and BN): the second normalisation cancels most of what the gain does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("scale", torch.rand(8, generator=torch.Generator().manual_seed(0)) + 0.5)
        self.norm = nn.BatchNorm1d(8, affine=False)
        with torch.no_grad():
            self.bn.bias.fill_(1e-3)  # a shift a few steps have moved off zero

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.bn(self.inp(x))) * self.scale))


class Attenuated(nn.Module):
    """A vanishing gradient: everything before the 1e-5 factor is attenuated."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)) * 1e-5)))


def test_a_tiny_gain_with_an_ordinary_gradient_behind_it_is_information_and_a_vanishing_one_a_warning():
    model = GainBeforeNorm()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    tiny = {f.name: f for f in report.findings if f.kind == "tiny_gradient"}
    assert "bn.weight" in tiny and not report.flagged(), str(report)
    assert tiny["bn.weight"].severity == "info" and "inp.weight" in tiny["bn.weight"].detail
    vanishing = Attenuated()
    report = diagnose(vanishing, torch.optim.SGD(vanishing.parameters(), lr=0.1), ce(vanishing))
    assert {f.name for f in report.flagged() if f.kind == "tiny_gradient"} >= {"inp.weight", "mid.weight"}, str(report)


class PreNormBranch(nn.Module):
    """A pre-norm residual block (h + fc2(gelu(fc1(norm(h))))) at a transformer's init: weights
    at a small std, biases near zero, the layer normalisation's gain at 1. The gain's values
    are large beside the rest, so its grad/param ratio falls past ``tiny_factor`` below the
    median (the std 0.01 and width 32 were chosen to put it there) although the gradient that
    reaches it is not attenuated. ``branch_scale`` 1e-5 scales the branch down: then the gradient
    reaching the block is attenuated, a bug. ``dropout`` adds a dropout in the branch (a closure
    that then draws random numbers)."""

    def __init__(self, branch_scale=1.0, width=32, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.head = nn.Linear(6, width), nn.LayerNorm(width), nn.Linear(width, 3)
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.branch_scale = branch_scale
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for lin in (self.inp, self.fc1, self.fc2, self.head):
                lin.weight.normal_(0, 0.01, generator=g)
                lin.bias.normal_(0, 1e-3, generator=g)
            self.norm.bias.normal_(0, 1e-3, generator=g)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.branch_scale * self.fc2(self.drop(F.gelu(self.fc1(self.norm(h))))))


def test_a_gain_at_one_reached_by_an_unattenuated_gradient_is_information_and_a_scaled_down_branch_a_warning():
    healthy = PreNormBranch()
    report = diagnose(healthy, torch.optim.SGD(healthy.parameters(), lr=0.1), ce(healthy))
    tiny = {f.name: f for f in report.findings if f.kind == "tiny_gradient"}
    assert "norm.weight" in tiny and not report.flagged(), str(report)
    assert tiny["norm.weight"].severity == "info" and "not attenuated" in tiny["norm.weight"].detail
    broken = PreNormBranch(branch_scale=1e-5)
    report = diagnose(broken, torch.optim.SGD(broken.parameters(), lr=0.1), ce(broken))
    assert ("tiny_gradient", "norm.weight", "warning") in {(f.kind, f.name, f.severity) for f in report.findings}, \
        str(report)


class DeepTanh(nn.Module):
    """A plain 32-layer tanh network at PyTorch's default init (weights of std 1/sqrt(3 fan_in)):
    each layer multiplies the gradient by about 1/sqrt(3), so it vanishes toward the input."""

    def __init__(self, depth=30, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(6, width), nn.Linear(width, 3)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def test_a_gradient_vanishing_through_depth_stays_a_warning():
    model = DeepTanh()
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model))
    assert ("tiny_gradient", "inp.bias", "warning") in {(f.kind, f.name, f.severity) for f in report.findings}, \
        str(report)


class SqueezeExcite(nn.Module):
    """A squeeze-excitation gate with two hidden units, as in an SE block: pooled channels ->
    fc1 -> ReLU -> fc2 -> sigmoid, scaling the features. ``shift`` moves fc1's output: at -4 both
    hidden units are off for every example of the batch below; ``broken`` multiplies the pooled
    input by zero (a zero made in front of the gate, on every batch)."""

    def __init__(self, shift: float, broken: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features, self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 2), nn.Linear(2, 6)
        self.head, self.shift, self.broken = nn.Linear(6, 3), shift, broken

    def forward(self, x):
        h = self.features(x)
        pooled = torch.tanh(h) * (0.0 if self.broken else 1.0)
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(pooled) + self.shift)))
        return self.head(h * gate)


def test_a_gate_closed_for_this_batch_is_information_and_a_zero_in_front_of_it_is_not():
    closed = SqueezeExcite(shift=-4.0)  # tanh keeps fc1's input within 1: both units below zero here
    report = diagnose(closed, torch.optim.SGD(closed.parameters(), lr=0.1), ce(closed))
    zero = {f.name: f for f in report.findings if f.kind == "zero_gradient"}
    assert set(zero) == {"fc1.weight", "fc1.bias", "fc2.weight"} and not report.flagged(), str(report)
    assert all(f.severity == "info" and "ReLU" in f.detail for f in zero.values())
    opened = SqueezeExcite(shift=4.0)  # the units on: no zero at all
    assert not [f for f in diagnose(opened, torch.optim.SGD(opened.parameters(), lr=0.1), ce(opened)).findings
                if f.kind == "zero_gradient"]
    broken = SqueezeExcite(shift=4.0, broken=True)  # fc1 reads zeros: its weight's gradient is zero past any gate
    report = diagnose(broken, torch.optim.SGD(broken.parameters(), lr=0.1), ce(broken))
    assert ("zero_gradient", "fc1.weight", "warning") in {(f.kind, f.name, f.severity) for f in report.flagged()}, \
        str(report)
