"""The random-direction test of tiny gradients (``causes.unaligned_gradients``) in its local
form: the random gradients go through the tensors' own operations alone (their backward nodes
called on the saved graph), and, where the closure drew no random numbers and a rerun gives
the same loss, on the graph of diagnose's own backward. Checked against the whole-model form
(a second backward pass through the whole graph), which the local form must reproduce number
for number, on a pre-norm block whose layer-norm gain is tiny by its role and on the same block
with its branch scaled down (the gradient reaching the gain truly attenuated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_finding_severity import PreNormBranch  # a pre-norm block: its gain tiny by role, or attenuated
from torch import nn

from gradrepro.diagnose import causes, diagnose

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(16, 6, generator=G), torch.randint(0, 3, (16,), generator=G)


def _decisions(model):
    report = diagnose(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda: F.cross_entropy(model(X), Y))
    return [(f.kind, f.name, f.severity) for f in report.findings]


def _spy(monkeypatch, whole: bool) -> list:
    """Records each call of the test (whether it was given diagnose's graph) and of the local
    form (whether it answered); with ``whole``, the local form never answers."""
    calls: list = []
    local, test = causes._local, causes.unaligned_gradients

    def spy_local(*args, **kwargs):
        out = None if whole else local(*args, **kwargs)
        calls.append(("local", out is not None))
        return out

    def spy_test(*args, graph=None, **kwargs):
        calls.append(("graph", graph is not None))
        return test(*args, graph=graph, **kwargs)

    monkeypatch.setattr(causes, "_local", spy_local)
    monkeypatch.setattr(causes, "unaligned_gradients", spy_test)
    return calls


class Tied(nn.Module):
    """One linear map applied twice (its weight and bias enter two operations: the local form
    calls those nodes whole, where a path from one reaches the other's leaves) and a gain that
    enters one operation twice (g * g)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h)))) * (self.gain * self.gain)
        return self.head(h)


@pytest.mark.parametrize("model_of", [lambda: PreNormBranch(1.0), lambda: PreNormBranch(1e-5), Tied])
def test_the_local_form_gives_the_whole_model_forms_numbers(model_of):
    model = model_of()
    tensors = list(model.parameters())
    closure = lambda: F.cross_entropy(model(X), Y)  # noqa: E731
    which = list(range(len(tensors)))
    local = causes.unaligned_gradients(closure, tensors, which)
    original = causes._local
    try:
        causes._local = lambda *a, **k: None  # the second backward pass through the whole graph
        whole = causes.unaligned_gradients(closure, tensors, which)
    finally:
        causes._local = original
    assert local == whole and set(whole) == set(which), (local, whole)  # the same numbers, bit for bit
    # And on a graph whose backward already ran (diagnose's own): the same numbers again.
    loss = closure()
    graph, handles = causes.watch_operations(loss.grad_fn, {id(t) for t in tensors})
    loss.backward(retain_graph=True)
    for h in handles:
        h.remove()
    assert causes._local(graph.root, graph.read, tensors, which, 0) == whole


@pytest.mark.parametrize("branch_scale, severity", [(1.0, "info"), (1e-5, "warning")])
def test_the_gain_tiny_by_its_role_is_information_and_attenuated_a_warning(branch_scale, severity):
    model = PreNormBranch(branch_scale)
    assert ("tiny_gradient", "norm.weight", severity) in _decisions(model)


@pytest.mark.parametrize("branch_scale", [1.0, 1e-5])
def test_diagnose_decides_the_same_with_the_local_and_the_whole_model_form(monkeypatch, branch_scale):
    calls = _spy(monkeypatch, whole=True)
    whole = _decisions(PreNormBranch(branch_scale))
    assert ("local", False) in calls  # the whole-model pass answered
    monkeypatch.undo()
    calls = _spy(monkeypatch, whole=False)
    local = _decisions(PreNormBranch(branch_scale))
    assert calls == [("graph", True), ("local", True)], calls  # diagnose's own graph, no forward of its own
    assert local == whole


def test_a_closure_that_draws_random_numbers_gets_a_rerun_of_its_own(monkeypatch):
    """Dropout draws a new mask on diagnose's forward pass: its graph is not the rerun's under
    the test's seed, so the test makes its own forward and first backward, as before."""
    calls = _spy(monkeypatch, whole=False)
    local = _decisions(PreNormBranch(dropout=0.1))
    assert calls == [("graph", False), ("local", True)], calls
    monkeypatch.undo()
    _spy(monkeypatch, whole=True)
    assert _decisions(PreNormBranch(dropout=0.1)) == local


class Branch(nn.Module):
    """A branch multiplied by a keep factor: 0 always (``alternate`` False), or 0 and 1 on
    alternate calls, from a call counter (state the random seed does not reach)."""

    def __init__(self, alternate=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.branch, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.alternate, self.calls = alternate, 0

    def forward(self, x):
        self.calls += 1
        keep = float(self.alternate and self.calls % 2 == 0)
        h = torch.tanh(self.inp(x))
        return self.head(h + keep * torch.tanh(self.branch(h)))


@pytest.mark.parametrize("alternate, expected", [(False, set()), (True, {2, 3})])
def test_a_draw_that_is_the_first_run_again_makes_no_backward_pass(monkeypatch, alternate, expected):
    """``causes.drawn_zeros`` skips the backward of a draw that drew no random numbers and gave
    the first run's loss bit for bit (the same graph: the same zeros); a closure whose next call
    differs by state the seed does not reach gives another loss, and its backward is made."""
    model = Branch(alternate)
    tensors = list(model.parameters())  # inp.weight, inp.bias, branch.weight, branch.bias, ...
    closure = lambda: F.cross_entropy(model(X), Y)  # noqa: E731
    first = closure()  # keep 0: the branch's gradient is zero
    assert not any(g.any() for g in torch.autograd.grad(first, tensors[2:4]))
    backward = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: backward.append(1) or grad(*a, **k))
    assert causes.drawn_zeros(closure, tensors, [2, 3], same_as=first.detach()) == expected
    assert len(backward) == (1 if alternate else 0)
    model.calls = 1
    assert causes.drawn_zeros(closure, tensors, [2, 3]) == expected  # without the shortcut
