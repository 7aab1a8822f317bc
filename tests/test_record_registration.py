"""Live checks of what the model holds and what edits its weights between steps:
layers or requires-grad tensors held without registration (``watch.checks.registration_hits``),
and an in-place clamp told from other edits (``watch.invariants.Fingerprints.projected``).
Each finding holds on its bug and not on its healthy twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro


class Stack(nn.Module):
    """Hidden layers in a Python list (``registered=False``: the bug) or an nn.ModuleList."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8) for _ in range(2)]
        self.hidden = nn.ModuleList(layers) if registered else layers
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def _data(n: int = 16):
    x = torch.randn(n, 6)
    return x, x[:, :3].argmax(1)


def _train(tmp_path, model, opt, steps: int = 6, after=None, every: int = 2):
    with gradrepro.record(model, opt, tmp_path / "run", every=every, activations=False, on_finding="log") as rec:
        for _ in range(steps):
            opt.zero_grad()
            x, y = _data()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if after is not None:
                after()
    return [(f.kind, f.name, f.severity) for f in rec.watch.found]


@pytest.mark.parametrize("registered", [False, True])
def test_layers_in_a_python_list_are_not_in_the_optimizer(tmp_path, registered):
    model = Stack(registered)
    with gradrepro.record(model, torch.optim.Adam(model.parameters(), lr=1e-3), tmp_path / "run", every=2,
                          activations=False, on_finding="log") as rec:
        opt = rec.optimizer
        for _ in range(4):
            opt.zero_grad()
            x, y = _data()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    found = [f for f in rec.watch.found]
    if registered:
        assert found == []
    else:  # one finding for both layers, at the first logged step
        assert [(f.kind, f.name, f.severity, f.step) for f in found] == [("not_in_optimizer", "hidden[0]", "error", 0)]
        assert "hidden[1]" in str(found[0]) and "nn.ModuleList" in str(found[0])


def test_an_unregistered_tensor_the_optimizer_holds_is_a_warning_not_a_stale_tensor(tmp_path):
    """A temperature made with requires_grad=True but no nn.Parameter, given to the optimizer by
    hand: it trains, but state_dict() and .to() miss it."""
    model = Stack(True)
    model.temperature = torch.ones(1, requires_grad=True)
    opt = torch.optim.Adam(list(model.parameters()) + [model.temperature], lr=1e-3)
    found = _train(tmp_path, model, opt)
    assert ("unregistered", "temperature", "warning") in found
    assert not any(kind == "stale_optimizer_param" for kind, _, _ in found)


def _clamp(model, c: float = 0.05):
    def after():
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-c, c)
    return after


def _shrink(model):
    def after():
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
    return after


def _max_norm(model):
    def after():  # a max-norm constraint on each output unit's weights (Srivastava et al. 2014, Sec. 5.1)
        with torch.no_grad():
            model.inp.weight.copy_(torch.renorm(model.inp.weight, 2, 0, 0.5))
    return after


def _zero_fill(model):
    def after():  # a re-initialisation that fills the weights with zeros: an edit, not a constraint
        with torch.no_grad():
            model.out.weight.zero_()
    return after


def _floor(model):
    def after():  # a non-negativity constraint
        with torch.no_grad():
            model.out.weight.clamp_(min=0)
    return after


@pytest.mark.parametrize("edit,kind,severity", [
    (_clamp, "projected_between_steps", "info"),  # WGAN's weight clipping (Arjovsky et al. 2017, Alg. 1)
    (_floor, "projected_between_steps", "info"),
    (_max_norm, "projected_between_steps", "info"),
    (_shrink, "changed_between_steps", "warning"),
    (_zero_fill, "changed_between_steps", "warning"),  # an edit that is not a projection onto a box
])
def test_a_clamp_between_steps_is_told_from_other_edits(tmp_path, edit, kind, severity):
    model = Stack(True)
    found = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.05), after=edit(model))
    kinds = {(k, s) for k, _, s in found}
    assert (kind, severity) in kinds
    other = "changed_between_steps" if kind == "projected_between_steps" else "projected_between_steps"
    assert not any(k == other for k, _ in kinds)


def test_an_averaged_copy_loaded_between_steps_is_not_a_clamp(tmp_path):
    model = Stack(True)
    average = {k: v.clone() for k, v in model.state_dict().items()}
    found = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.05),
                   after=lambda: model.load_state_dict(average))
    assert any(k == "changed_between_steps" for k, _, _ in found)
    assert not any(k == "projected_between_steps" for k, _, _ in found)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


@pytest.mark.parametrize("master", [False, True])
def test_updates_rounded_away_in_bf16_weights_are_not_updated(tmp_path, master):
    """bf16 weights stepped by Adam at lr 1e-4: a LayerNorm gain at 1.0 moves by about 1e-4, under
    half a bf16 ulp there (2^-9), so it never changes; with float32 master weights (bf16 autocast)
    it moves. The finding holds on the first and not on the second."""
    model = _Normed() if master else _Normed().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        for _ in range(4):
            opt.zero_grad()
            x, y = _data()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master):
                out = model(x if master else x.bfloat16())
            F.cross_entropy(out.float(), y).backward()
            opt.step()
    found = {(f.kind, f.name) for f in rec.watch.found}
    if master:
        assert found == set()
    else:
        assert ("not_updated", "norm.weight") in found
        assert "float32 master copy" in str(next(f for f in rec.watch.found if f.name == "norm.weight"))


class _Blocks(nn.Module):
    """Three hidden blocks: three built (``repeat=False``), one built and repeated in the list
    (the bug), or one MLP held by two attributes (sharing on purpose, as timm's CoaT does)."""

    def __init__(self, repeat: bool = False, shared_attrs: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        block = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([block] * 3 if repeat else [nn.Linear(8, 8) for _ in range(3)])
        if shared_attrs:
            self.mlp_a = self.mlp_b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = torch.relu(b(h))
        if hasattr(self, "mlp_a"):
            h = self.mlp_a(h) + self.mlp_b(h)
        return self.out(h)


@pytest.mark.parametrize("repeat,shared_attrs", [(True, False), (False, False), (False, True)])
def test_one_module_repeated_in_a_list_is_found(tmp_path, repeat, shared_attrs):
    model = _Blocks(repeat, shared_attrs)
    found = _train(tmp_path, model, torch.optim.Adam(model.parameters(), lr=1e-3))
    assert found == ([("repeated_module", "blocks.0", "warning")] if repeat else [])


@pytest.mark.parametrize("how", ["attribute", "method", "config_flag"])
def test_a_freeze_by_attribute_is_found(tmp_path, how):
    """``module.requires_grad = False`` freezes nothing (found); ``requires_grad_(False)`` does
    (silent); a module keeping a True flag of its own under that name is not a freeze (silent)."""
    model = Stack(True)
    if how == "attribute":
        model.out.requires_grad = False
    elif how == "method":
        model.out.requires_grad_(False)
    else:
        model.out.requires_grad = True
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    found = _train(tmp_path, model, opt)
    assert found == ([("freeze_noop", "out", "warning")] if how == "attribute" else [])


@pytest.mark.parametrize("p,momentum,expected", [
    (True, 0.1, [("dropout_all", "drop", "warning")]),  # a flag passed as the rate: p = 1
    (0.5, 0.99, [("norm_momentum", "norm", "warning")]),  # TensorFlow's momentum convention
    (0.5, 0.1, []),  # PyTorch's defaults
    (0.5, 0.01, []),  # TensorFlow's 0.99 converted
])
def test_a_dropout_that_drops_all_and_an_inverted_norm_momentum_are_found(tmp_path, p, momentum, expected):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(6, 16))
    model.add_module("norm", nn.BatchNorm1d(16, momentum=momentum))
    model.add_module("act", nn.ReLU())
    model.add_module("drop", nn.Dropout(p))
    model.add_module("out", nn.Linear(16, 3))
    found = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert found == expected


def _pulled_toward_slow_weights(model, alpha: float, period: int):
    """Lookahead's sync (Zhang et al. 2019, Alg. 1) every ``period`` steps: the slow weights move
    ``alpha`` of the way to the fast ones, and the fast weights are reset to them."""
    slow = [p.detach().clone() for p in model.parameters()]
    count = [0]

    def after():
        count[0] += 1
        if count[0] % period == 0:
            with torch.no_grad():
                for s, p in zip(slow, model.parameters()):
                    s.add_(p - s, alpha=alpha)
                    p.copy_(s)
    return after


def _ema_swapped_in(model, decay: float, period: int):
    """An exponential moving average kept every step and loaded into the model every ``period``
    steps, never swapped back: the weights the optimizer made are lost."""
    ema = [p.detach().clone() for p in model.parameters()]
    count = [0]

    def after():
        count[0] += 1
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(decay).add_(p, alpha=1 - decay)
            if count[0] % period == 0:
                for e, p in zip(ema, model.parameters()):
                    p.copy_(e)
    return after


@pytest.mark.parametrize("alpha,period", [(0.5, 3), (0.8, 2), (0.1, 3)])
def test_a_pull_toward_slow_weights_is_told_from_a_copy_loaded(tmp_path, alpha, period):
    """Lookahead (alpha 0.5 and 0.8, the paper's values) and a Reptile-sized outer step (0.1): the
    weights land on the segment back toward their last synced values, every sampled entry by
    the same fraction: information, not the warning a copy loaded gets."""
    model = Stack(True)
    found = _train(tmp_path, model, torch.optim.Adam(model.parameters(), lr=1e-2), steps=7,
                   after=_pulled_toward_slow_weights(model, alpha, period))
    assert ("interpolated_between_steps", "info") in {(k, s) for k, _, s in found}
    assert not any(k == "changed_between_steps" for k, _, _ in found)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_an_ema_loaded_every_few_steps_is_still_a_copy_loaded(tmp_path, opt_name):
    """An EMA (decay 0.9) loaded every 3 steps: the average of a curved path is not on the segment
    toward the last synced weights, so it stays ``changed_between_steps`` (a warning)."""
    model = Stack(True)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd_momentum"
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    found = _train(tmp_path, model, opt, steps=7, after=_ema_swapped_in(model, 0.9, 3))
    assert any(k == "changed_between_steps" and s == "warning" for k, _, s in found)
    assert not any(k == "interpolated_between_steps" for k, _, _ in found)
