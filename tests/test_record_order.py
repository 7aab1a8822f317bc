"""Live checks of the loop's order around the optimizer: weights that change between forward
passes while the optimizer given to the recorder never steps (``changed_without_step``), and a
step that runs before the backward meant to feed it (``grad_reset_in_step`` on the whole
model). Each holds on its bug and is silent on the healthy loops of the same shape
(accumulation, SAM's perturbed second pass, a loss that does not reach the model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _data(n: int = 16):
    x = torch.randn(n, 6)
    return x, x[:, :3].argmax(1)


def _found(rec) -> list:
    return [(f.kind, f.name, f.severity, f.step) for f in rec.watch.found]


@pytest.mark.parametrize("every", [1, 4])
def test_an_optimizer_made_anew_every_batch_is_not_the_one_recorded(tmp_path, every):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradrepro.record(model, opt, tmp_path / "run", every=every, activations=False, on_finding="log") as rec:
        for _ in range(12):
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # the bug: a new optimizer each batch
            opt.zero_grad()
            x, y = _data()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    found = _found(rec)
    assert [f[0] for f in found] == ["changed_without_step"] and found[0][2] == "warning", found


@pytest.mark.parametrize("micro", [1, 8])
def test_the_recorded_optimizer_stepping_after_accumulation_is_silent(tmp_path, micro):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        for _ in range(6):
            opt.zero_grad()
            for _ in range(micro):
                x, y = _data()
                (F.cross_entropy(model(x), y) / micro).backward()
            opt.step()
    assert _found(rec) == []


@pytest.mark.parametrize("every", [1, 2])
def test_sams_perturbed_second_pass_is_silent(tmp_path, every):
    """Sharpness-aware minimisation (Foret et al. 2021): ascend to w + e, a second forward and
    backward there, back to w, then the base optimizer's step."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradrepro.record(model, opt, tmp_path / "run", every=every, activations=False, on_finding="log") as rec:
        for _ in range(6):
            x, y = _data()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                shifts = [0.05 * p.grad / (norm + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), shifts):
                    p.add_(e)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), shifts):
                    p.sub_(e)
            opt.step()
    assert _found(rec) == []


def test_a_step_before_its_backward_is_named(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=4, activations=False, on_finding="log") as rec:
        for _ in range(9):
            opt.zero_grad()
            x, y = _data()
            loss = F.cross_entropy(model(x), y)
            opt.step()  # the bug: the step before the backward
            loss.backward()
    found = _found(rec)
    assert ("grad_reset_in_step", "<model>", "warning", 0) in found
    assert not any(kind == "no_gradient" for kind, *_ in found)


def test_a_loss_that_does_not_reach_the_model_is_still_no_gradient(tmp_path):
    """The control: no backward reaches the model at all (the loss built from .item())."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=4, activations=False, on_finding="log") as rec:
        for _ in range(9):
            opt.zero_grad()
            x, y = _data()
            out = model(x)
            loss = torch.tensor(F.cross_entropy(out, y).item(), requires_grad=True)
            loss.backward()
            opt.step()
    found = _found(rec)
    assert ("no_gradient", "<model>", "error", 0) in found
    assert not any(kind == "grad_reset_in_step" for kind, *_ in found)


@pytest.mark.parametrize("through_scaler", [False, True])
def test_a_step_on_scaled_gradients_is_found(tmp_path, through_scaler):
    """The loss scaled by a GradScaler, then optimizer.step() called directly (the bug), against
    scaler.step(optimizer) and scaler.update()."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log",
                          scaler=scaler) as rec:
        for _ in range(4):
            opt.zero_grad()
            x, y = _data()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if through_scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    found = _found(rec)
    assert found == ([] if through_scaler else [("scaled_step", "<model>", "error", 0)])


def test_a_held_finding_raised_at_close_keeps_the_folder(tmp_path):
    """on_finding="raise" with the loss cut on the last step: the whole-model finding is held to
    the next forward pass, which never comes; close() writes the folder, then raises it."""
    from gradrepro.watch.watcher import FindingError

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradrepro.record(model, opt, tmp_path / "run", every=1, activations=False, on_finding="raise")
    x, y = _data()
    out = model(x)
    torch.tensor(F.cross_entropy(out, y).item(), requires_grad=True).backward()
    opt.step()
    with pytest.raises(FindingError):
        rec.close()
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "modules.parquet").exists()


@pytest.mark.parametrize("assigned", [True, False])
def test_gradients_assigned_by_hand_after_autograd_grad_are_not_stale(tmp_path, assigned):
    """Per-sample clipping without torch.func: each sample's gradient by autograd.grad (which
    leaves .grad alone), clipped, averaged, put in .grad after zero_grad(): not stale. The
    control adds the average into the .grad the last step left (no zero_grad): stale."""
    model = _mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        for _ in range(6):
            x, y = _data(4)
            total = [torch.zeros_like(p) for p in params]
            for i in range(4):
                grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
                norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
                for acc, g in zip(total, grads):
                    acc.add_(g, alpha=min(1.0, 1.0 / (norm + 1e-6)) / 4)
            if assigned:
                opt.zero_grad()
                for p, acc in zip(params, total):
                    p.grad = acc
            else:
                for p, acc in zip(params, total):
                    if p.grad is None:
                        p.grad = acc
                    else:
                        p.grad.add_(acc)
            opt.step()
    kinds = {kind for kind, *_ in _found(rec)}
    assert kinds == (set() if assigned else {"stale_gradient"})
