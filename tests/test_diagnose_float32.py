"""diagnose's float32 arithmetic (``gradrepro.diagnose.float32_check``): its norms hold the
float64 norm inside their bounds, and the SGD update check it decides agrees with the float64
check on honest and on tampered steps, for every SGD setting; tensors large enough to take it."""

import math

import pytest
import torch
from torch import nn

from gradrepro.diagnose import diagnose, float32_check
from gradrepro.diagnose.transition import grads_may_be_rewritten
from gradrepro.diagnose.update_rule import predict, snapshot_state

SHAPE = (96, 128)  # 12288 entries: above float32_check.SMALL


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-3, 1.0, 1e15, 1e25])
def test_norm_bounds_hold_the_float64_norm_or_say_nothing(scale):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(SHAPE, generator=g) * scale).float()
    exact = float(torch.linalg.vector_norm(t.double()))
    b = float32_check.norm_bounds(t)
    if scale >= 1e25:  # squares overflow float32
        assert b is None
        return
    assert b is not None and b.lo <= exact <= b.hi
    if scale >= 1e-3:
        assert abs(b.value - exact) <= 1e-6 * exact
    if scale <= 1e-20:  # squares underflow: the estimate is not taken
        assert float32_check.norm(t) is None


SETTINGS = {
    "plain": {},
    "weight_decay": {"weight_decay": 0.1},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    "dampening": {"momentum": 0.5, "dampening": 0.3},
    "maximize": {"maximize": True, "momentum": 0.9},
}


def _float64_check(after, start, grad, state, group, rtol):
    predicted = predict(torch.optim.SGD([torch.zeros(1)], lr=0.1), group, start.double(), grad, state)
    err = float(torch.linalg.vector_norm(after.double() - predicted))
    expected = float(torch.linalg.vector_norm(predicted - start.double()))
    return err <= rtol * expected + 2 * torch.finfo(torch.float32).eps * float(torch.linalg.vector_norm(after.double()))


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("tamper", [0.0, 1e-2, 1e-4])
def test_sgd_check_in_float32_agrees_with_the_float64_check(setting, tamper):
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(SHAPE))
    opt = torch.optim.SGD([p], lr=0.05, **SETTINGS[setting])
    scratch = float32_check.Scratch(p.numel(), p.device)
    decided = 0
    for _ in range(3):  # the momentum buffer's first step and later ones
        p.grad = torch.randn(SHAPE)
        start, grad, state = p.detach().clone(), p.grad.clone(), snapshot_state(opt, p)
        opt.step()
        with torch.no_grad():
            p.add_(torch.randn(SHAPE) * tamper * float(torch.linalg.vector_norm(p - start)) / math.sqrt(p.numel()))
        group = opt.param_groups[0]
        verdict = float32_check.sgd_check(p.detach(), start, grad, state, group, 1e-3, scratch)
        truth = _float64_check(p.detach(), start, grad, state, group, 1e-3)
        if verdict is not None:
            decided += 1
            assert verdict.matches == truth
        with_norm = float32_check.sgd_check(p.detach(), start, grad, state, group, 1e-3, scratch,
                                            grad_norm=float(torch.linalg.vector_norm(grad.double())))
        assert with_norm is None or with_norm.matches == truth
        assert truth == (tamper < 1e-3)
    assert decided == 3  # far from the threshold, float32 decides every one


ADAM = {
    "adam": (torch.optim.Adam, {}),
    "adam_maximize": (torch.optim.Adam, {"maximize": True, "betas": (0.8, 0.99)}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "adamw_small_eps": (torch.optim.AdamW, {"eps": 1e-12, "weight_decay": 0.01}),
}


def _float64_adam_check(opt, after, start, grad, state, group, rtol):
    predicted = predict(opt, group, start.double(), grad, state)
    err = float(torch.linalg.vector_norm(after.double() - predicted))
    expected = float(torch.linalg.vector_norm(predicted - start.double()))
    return err <= rtol * expected + 2 * torch.finfo(torch.float32).eps * float(torch.linalg.vector_norm(after.double()))


@pytest.mark.parametrize("setting", sorted(ADAM))
@pytest.mark.parametrize("tamper", [0.0, 1e-2, 1e-4])
def test_adam_check_in_float32_agrees_with_the_float64_check(setting, tamper):
    torch.manual_seed(2)
    cls, kwargs = ADAM[setting]
    p = nn.Parameter(torch.randn(SHAPE))
    opt = cls([p], lr=1e-3, **kwargs)
    scratch = float32_check.Scratch(p.numel(), p.device)
    decided = 0
    for _ in range(3):  # the moments' first step and later ones
        p.grad = torch.randn(SHAPE) * 1e-2
        start, grad, state = p.detach().clone(), p.grad.clone(), snapshot_state(opt, p)
        opt.step()
        with torch.no_grad():
            p.add_(torch.randn(SHAPE) * tamper * float(torch.linalg.vector_norm(p - start)) / math.sqrt(p.numel()))
        group = opt.param_groups[0]
        verdict = float32_check.adam_check(p.detach(), start, grad, state, group, cls is torch.optim.AdamW, 1e-3,
                                           scratch, start_norm=float(torch.linalg.vector_norm(start.double())))
        truth = _float64_adam_check(opt, p.detach(), start, grad, state, group, 1e-3)
        if verdict is not None:
            decided += 1
            assert verdict.matches == truth
        assert truth == (tamper < 1e-3)
    # eps = 1e-12: underflow could move the denominator by more than 1e-6 of it, so float64 decides
    assert decided == (0 if setting == "adamw_small_eps" else 3)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_step_nudged_by_a_post_hook_is_a_mismatch_on_large_float32_tensors(optimizer):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 64))
    x, y = torch.randn(8, 128), torch.randint(0, 64, (8,))
    opt = OPTIMIZERS[optimizer](net.parameters())

    def closure():
        return nn.functional.cross_entropy(net(x), y)

    for _ in range(2):  # the optimizer's state exists
        opt.zero_grad()
        closure().backward()
        opt.step()
    assert not diagnose(net, opt, closure).flagged()

    def nudge(o, a, k):
        with torch.no_grad():
            net[0].weight.mul_(1.0001)

    handle = opt.register_step_post_hook(nudge)
    report = diagnose(net, opt, closure)
    handle.remove()
    assert {(f.kind, f.name) for f in report.flagged()} == {("update_mismatch", "0.weight")}, str(report)


def test_the_gradients_are_copied_only_where_a_hook_or_a_custom_step_can_rewrite_them():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    assert not grads_may_be_rewritten(opt)
    handle = opt.register_step_pre_hook(lambda *_: None)
    assert grads_may_be_rewritten(opt)
    handle.remove()

    class Custom(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert grads_may_be_rewritten(Custom([p], lr=0.1))


def test_a_live_recorders_hooks_on_every_optimizer_do_not_count_as_rewriting_gradients(tmp_path):
    """gradrepro.record's carried-gradient check holds a global step hook that only reads .grad:
    diagnose of another model beside a live recorder keeps its fast path; another global hook still counts."""
    from torch.optim import optimizer as torch_optimizer

    import gradrepro

    net = nn.Linear(4, 2)
    rec = gradrepro.record(net, torch.optim.SGD(net.parameters(), lr=0.1), tmp_path / "run", every=1,
                           activations=False, on_finding="log")
    opt = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)  # another model's, not recorded
    try:
        assert len(torch_optimizer._global_optimizer_pre_hooks) > 0
        assert not grads_may_be_rewritten(opt)
        handle = torch_optimizer.register_optimizer_step_post_hook(lambda *_: None)
        assert grads_may_be_rewritten(opt)
        handle.remove()
    finally:
        rec.close()


class _WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 4)
        self.spare = nn.Linear(3, 3)  # never used: its missing gradient makes diagnose rerun the closure

    def forward(self, x):
        return self.b(self.a(x))


def test_the_closures_reruns_see_no_gradient_and_cannot_change_the_one_the_step_uses():
    torch.manual_seed(0)
    net = _WithSpare()
    x, y = torch.randn(5, 16), torch.randint(0, 4, (5,))
    calls, saw = [0], [0]

    def closure():
        calls[0] += 1
        if net.b.weight.grad is not None:
            saw[0] += 1
            with torch.no_grad():
                net.b.weight.grad.mul_(-1.0)
        return nn.functional.cross_entropy(net(x), y)

    report = diagnose(net, torch.optim.SGD(net.parameters(), lr=0.1), closure)
    assert calls[0] > 1 and saw[0] == 0  # rerun, as its first run, with .grad None
    assert not {k for k, _ in {(f.kind, f.name) for f in report.flagged()}} & {"grad_modified", "update_mismatch"}
