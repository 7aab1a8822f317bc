"""``gradrepro.record(model, [opt_a, opt_b], ...)``: several optimizers over one model, stepped in
turn after each backward (Muon and AdamW, SparseAdam and Adam), recorded as one step each;
the checks read every optimizer's groups, the update rule each group's own optimizer; bad
input is one line."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.errors import UserError
from gradrepro.watch.optimizers import OptimizerSet


class Tagger(nn.Module):
    """A sparse embedding (SparseAdam's tensors) and a dense head (Adam's)."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 8, sparse=sparse)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def _tokens(n: int = 16):
    x = torch.randint(0, 30, (n, 5))
    return x, x[:, 0] % 3


def _train(tmp_path, model, optimizers, steps: int = 10, every: int = 2, skip=None, recorded=None, **options):
    """One backward, then each optimizer's step in turn; ``skip(step)`` names optimizers that do
    not step that time (as a GradScaler skips one with non-finite gradients)."""
    with gradrepro.record(model, recorded if recorded is not None else optimizers, tmp_path / "run", every=every,
                          activations=False, on_finding="log", **options) as rec:
        for step in range(steps):
            for opt in optimizers:
                opt.zero_grad()
            x, y = _tokens()
            F.cross_entropy(model(x), y).backward()
            for i, opt in enumerate(optimizers):
                if skip is None or i not in skip(step):
                    opt.step()
    return rec, pd.read_parquet(tmp_path / "run" / "modules.parquet"), {f.kind for f in rec.watch.found}


def test_sparse_adam_and_adam_are_one_step_each_and_both_parts_move(tmp_path):
    model = Tagger()
    sparse = torch.optim.SparseAdam(list(model.embed.parameters()), lr=1e-2)
    dense = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    rec, modules, found = _train(tmp_path, model, [sparse, dense])
    assert rec.step == 10  # one recorded step per backward, not one per optimizer step
    assert found == set()
    last = modules[modules.step == modules.step.max()]
    assert set(last.module) == {"embed", "head.0", "head.2"}
    assert (last["update_to_param"] > 0).all(), last  # both optimizers' tensors moved


def test_one_optimizer_of_the_two_given_alone_names_the_other_part(tmp_path):
    """The control of the test above: given one optimizer, the other's tensors are outside it."""
    model = Tagger(sparse=False)
    a, b = torch.optim.SGD(model.embed.parameters(), lr=0.1), torch.optim.Adam(model.head.parameters(), lr=1e-2)
    _, _, found = _train(tmp_path, model, [a, b], recorded=a)
    assert "not_in_optimizer" in found


def test_a_tensor_in_neither_optimizer_is_still_found(tmp_path):
    model = Tagger(sparse=False)
    a = torch.optim.SGD(model.embed.parameters(), lr=0.1)
    b = torch.optim.Adam(model.head[0].parameters(), lr=1e-2)  # the last layer forgotten
    _, _, found = _train(tmp_path, model, [a, b])
    assert "not_in_optimizer" in found


def test_each_group_is_checked_by_its_own_optimizers_rule(tmp_path):
    """SGD and Adam, healthy: silent; a gradient flipped inside Adam's step (a pre-hook added after
    the recorder's): an update mismatch named by Adam's rule."""
    model = Tagger(sparse=False)
    a = torch.optim.SGD(model.embed.parameters(), lr=0.1, momentum=0.9)
    b = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    rec, _, found = _train(tmp_path / "healthy", model, [a, b], every=1, steps=6)
    assert rec.watch.rule.enabled and found == set()

    model = Tagger(sparse=False)
    a = torch.optim.SGD(model.embed.parameters(), lr=0.1, momentum=0.9)
    b = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    with gradrepro.record(model, [a, b], tmp_path / "bug", every=1, activations=False, on_finding="log") as rec:
        def flip(*_):
            for p in model.head[2].parameters():
                p.grad.mul_(-1.0)
        b.register_step_pre_hook(flip)
        for _ in range(3):
            a.zero_grad()
            b.zero_grad()
            x, y = _tokens()
            F.cross_entropy(model(x), y).backward()
            a.step()
            b.step()
    found = [f for f in rec.watch.found if f.kind == "update_mismatch"]
    assert found and found[0].step == 0 and "Adam rule" in str(found[0])


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_muon_for_the_matrices_and_adamw_for_the_rest(tmp_path):
    """The hidden layer's matrix under Muon, the embedding, biases and head under AdamW: silent,
    every tensor moves, and the rule check covers AdamW's groups (Muon's rule is not predicted)."""
    model = Tagger(sparse=False)
    hidden = [model.head[0].weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon, adamw = torch.optim.Muon(hidden, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)
    rec, modules, found = _train(tmp_path, model, [muon, adamw], every=1, steps=4)
    assert found == set() and rec.watch.rule.enabled
    assert (modules[modules.step == 3]["update_to_param"] > 0).all()


def test_an_optimizer_that_skips_a_step_ends_that_step_at_the_next(tmp_path):
    """Adam skipped on steps 3 and 4: still one recorded step per backward, and the hooks of
    both optimizers are gone after close."""
    model = Tagger(sparse=False)
    a, b = torch.optim.SGD(model.embed.parameters(), lr=0.1), torch.optim.Adam(model.head.parameters(), lr=1e-2)
    rec, modules, _ = _train(tmp_path, model, [a, b], skip=lambda step: {1} if step in (3, 4) else set())
    assert rec.step == 10
    assert sorted(modules.step.unique()) == [0, 2, 4, 6, 8]
    assert not a._optimizer_step_pre_hooks and not b._optimizer_step_post_hooks


@pytest.mark.parametrize("given,fragment", [
    ([], "empty list"),
    (["adam"], "optimizer[0] must be a torch.optim.Optimizer, not str"),
])
def test_bad_optimizer_lists_are_one_line(tmp_path, given, fragment):
    with pytest.raises(UserError) as err:
        gradrepro.record(Tagger(), given, tmp_path / "run")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_tensor_in_two_optimizers_is_refused(tmp_path):
    model = Tagger(sparse=False)
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    with pytest.raises(UserError) as err:
        gradrepro.record(model, [a, b], tmp_path / "run")
    assert "optimizer[0] and optimizer[1] both hold" in str(err.value)
    assert not (tmp_path / "run").exists()  # refused before the folder is claimed


def test_the_set_reads_as_its_members():
    model = Tagger(sparse=False)
    a, b = torch.optim.SGD(model.embed.parameters(), lr=0.1), torch.optim.Adam(model.head.parameters(), lr=1e-2)
    both = OptimizerSet([a, b])
    assert both.param_groups == a.param_groups + b.param_groups
    assert repr(both) == "OptimizerSet(SGD, Adam)"
