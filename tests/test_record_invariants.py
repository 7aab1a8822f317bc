"""The training step's invariants that ``gradrepro.record`` checks live
(``gradrepro.watch.invariants``): each one found on its bug and silent on the healthy twin;
the recorder's own failures as one ``recorder_error`` finding with training going on; lazy
modules recorded; a meta-device model; bad input as one line."""

from __future__ import annotations

import copy
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.errors import UserError
from gradrepro.watch.watcher import FindingError, TrainingFinding


def _mlp(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))


def _data(n: int = 16):
    x = torch.randn(n, 6)
    return x, x[:, :3].argmax(1)


def _train(tmp_path, model, opt, steps: int = 12, each=None, every: int = 4, micro: int = 1, reset=None,
           set_to_none: bool = True, **options):
    """The textbook loop (``micro`` backward passes a step); ``each(step)`` before each step,
    ``reset(step, i)`` before each micro-batch. Returns the recorder and the live findings' kinds."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradrepro.record(model, opt, tmp_path / "run", every=every, activations=False, **options) as rec:
            for step in range(steps):
                if each is not None:
                    each(step)
                opt.zero_grad(set_to_none=set_to_none)
                for i in range(micro):
                    if reset is not None:
                        reset(step, i)
                    x, y = _data()
                    (F.cross_entropy(model(x), y) / micro).backward()
                opt.step()
    warned = [str(w.message) for w in caught if issubclass(w.category, TrainingFinding)]
    return rec, {(f.kind, f.step) for f in rec.watch.found}, warned


def _ema_loop(tmp_path, restore: bool):
    model = _mlp()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def each(step):
        with torch.no_grad():
            for p, e in zip(model.parameters(), ema.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            if step == 6:  # validate with the EMA's weights
                backup = [p.clone() for p in model.parameters()]
                for p, e in zip(model.parameters(), ema.parameters()):
                    p.copy_(e)
                model(_data()[0])
                if restore:
                    for p, b in zip(model.parameters(), backup):
                        p.copy_(b)
    return _train(tmp_path, model, opt, each=each)


def test_weights_swapped_in_and_not_restored_are_found_at_the_next_step(tmp_path):
    rec, found, warned = _ema_loop(tmp_path, restore=False)
    assert ("changed_between_steps", 6) in found  # an unlogged step (every=4): found at once, on CPU
    finding = next(f for f in rec.watch.found if f.kind == "changed_between_steps")
    assert finding.evidence["tensors_changed"] == 4 and "EMA" in finding.detail
    assert any("changed_between_steps" in w for w in warned)


def test_weights_swapped_and_restored_are_silent(tmp_path):
    _, found, warned = _ema_loop(tmp_path, restore=True)
    assert found == set() and warned == []


def test_an_edit_in_place_of_one_tensor_names_that_tensor(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def each(step):
        if step == 5:
            with torch.no_grad():
                model[3].weight.div_(model[3].weight.norm(dim=1, keepdim=True))
    rec, found, _ = _train(tmp_path, model, opt, each=each)
    assert found == {("changed_between_steps", 5)}
    assert rec.watch.found[0].name == "3.weight" and "in place" in rec.watch.found[0].detail


def _freeze_loop(tmp_path, drop_grads: bool):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def each(step):
        if step == 5:
            model[0].requires_grad_(False)
            if drop_grads:
                for p in model[0].parameters():
                    p.grad = None
    return _train(tmp_path, model, opt, each=each, set_to_none=False)


def test_a_frozen_tensor_moved_by_momentum_is_found(tmp_path):
    rec, found, _ = _freeze_loop(tmp_path, drop_grads=False)
    assert found == {("frozen_moved", 5)}
    finding = next(f for f in rec.watch.found if f.kind == "frozen_moved")
    assert finding.name == "0.weight" and finding.evidence["tensors_moved"] == 2


def test_a_frozen_tensor_without_a_gradient_stays_and_is_silent(tmp_path):
    _, found, _ = _freeze_loop(tmp_path, drop_grads=True)
    assert found == set()


class _WithTarget(nn.Module):
    """An online network and, inside the same module, a frozen target copy of it (BYOL's and
    MoCo's key encoder, a mean teacher, DQN's target network); only the online part trains."""

    def __init__(self) -> None:
        super().__init__()
        self.online = _mlp()
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        return self.online(x) + 0.0 * self.target(x).detach()


def _target_loop(tmp_path, update):
    model = _WithTarget()
    opt = torch.optim.SGD(model.online.parameters(), lr=0.1, momentum=0.9)

    def each(step):
        if step:
            with torch.no_grad():
                update(step, list(model.target.parameters()), list(model.online.parameters()))
    return _train(tmp_path, model, opt, each=each)


@pytest.mark.parametrize("update", ["polyak_0.99", "polyak_0.996_mul_add", "copy_every_4"])
def test_a_target_network_kept_from_the_trained_one_is_information(tmp_path, update):
    """Frozen tensors moved between steps onto the segment toward the trained tensors of the same
    shape: Polyak averaging (BYOL's tau 0.99 and 0.996, written as lerp_ and as mul_/add_) or a
    copy every 4 steps (DQN): ``target_network_update`` at info, no ``frozen_moved`` warning."""
    def step_of(step, target, online):
        for t, o in zip(target, online):
            if update == "polyak_0.99":
                t.lerp_(o, 0.01)
            elif update == "polyak_0.996_mul_add":
                t.mul_(0.996).add_(o, alpha=0.004)
            elif step % 4 == 0:
                t.copy_(o)
    rec, found, _ = _target_loop(tmp_path, step_of)
    kinds = {k for k, _ in found}
    assert kinds == {"target_network_update"}
    first = next(f for f in rec.watch.found if f.kind == "target_network_update")
    assert first.severity == "info" and first.evidence["tensors_moved"] == 4
    expected = {"polyak_0.99": 0.01, "polyak_0.996_mul_add": 0.004, "copy_every_4": 1.0}[update]
    assert first.evidence["alpha_min"] == pytest.approx(expected, rel=1e-3)


def test_a_frozen_target_decayed_by_hand_is_still_frozen_moved(tmp_path):
    """The same frozen copy shrunk by a hand-written decay (p *= 1 - lr * wd over every tensor):
    not toward a trained tensor, so the warning stays."""
    def decay(step, target, online):
        for t in target:
            t.mul_(1 - 0.1 * 0.05)
    _, found, _ = _target_loop(tmp_path, decay)
    assert {k for k, _ in found} == {"frozen_moved"}


class _Adapted(nn.Module):
    """A frozen base layer with a trainable low-rank adapter (LoRA: W x + B A x), and the
    evaluation habit of merging B A into W and taking it out again afterwards."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base, self.head = nn.Linear(6, 16).requires_grad_(False), nn.Linear(16, 3)
        self.a, self.b = nn.Parameter(torch.randn(4, 6) * 0.3), nn.Parameter(torch.randn(16, 4) * 0.3)

    def forward(self, x):
        return self.head(torch.relu(self.base(x) + x @ self.a.t() @ self.b.t()))


@pytest.mark.parametrize("merges", [1, 2])
def test_an_adapter_merged_and_unmerged_is_rounding_and_merged_twice_is_frozen_moved(tmp_path, merges):
    """Every 4 steps the loop merges the adapter into the frozen base weight ``merges`` times for
    an evaluation and unmerges it once: once leaves the base within a round trip's rounding
    (``rounded_between_steps``, info); twice leaves the adapter in it (``frozen_moved``)."""
    model = _Adapted()
    opt = torch.optim.AdamW([model.a, model.b, *model.head.parameters()], lr=0.01)

    def each(step):
        if step and step % 4 == 0:
            with torch.no_grad():
                delta = model.b @ model.a
                for _ in range(merges):
                    model.base.weight += delta
                model.base.weight -= delta
    rec, found, _ = _train(tmp_path, model, opt, each=each)
    kinds = {k for k, _ in found}
    if merges == 1:
        assert kinds == {"rounded_between_steps"}
        first = next(f for f in rec.watch.found if f.kind == "rounded_between_steps")
        assert first.severity == "info" and first.name == "base.weight"
    else:
        assert ("frozen_moved", 4) in found and "rounded_between_steps" not in kinds


def test_a_frozen_tensor_decayed_by_hand_between_steps_is_not_rounding(tmp_path):
    """A hand-written decay of 1e-4 per step (far above float32's epsilon, 1.2e-7) on the frozen
    base is a change, not rounding: ``frozen_moved`` stays."""
    model = _Adapted()
    opt = torch.optim.AdamW([model.a, model.b, *model.head.parameters()], lr=0.01)

    def each(step):
        with torch.no_grad():
            model.base.weight.mul_(1 - 1e-4)
    _, found, _ = _train(tmp_path, model, opt, each=each)
    assert {k for k, _ in found} == {"frozen_moved"}


def test_gradients_reset_between_micro_batches_are_found(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec, found, _ = _train(tmp_path, model, opt, micro=3, reset=lambda step, i: opt.zero_grad())
    assert ("grad_reset_in_step", 0) in found
    assert next(f for f in rec.watch.found if f.kind == "grad_reset_in_step").evidence["tensors_reset"] == 4


def test_accumulated_micro_batches_are_silent(tmp_path):
    model = _mlp(0.1)
    _, found, _ = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), micro=3)
    assert found == set()


def test_a_second_backward_after_the_weights_moved_is_silent(tmp_path):
    """Sharpness-aware minimisation: the first gradient moved the weights before it was reset."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1, activations=False) as rec:
        for _ in range(6):
            x, y = _data()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                eps = [0.05 * p.grad / p.grad.norm() for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            opt.step()
    assert rec.watch.found == []


class _FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(F.dropout(F.relu(self.a(x)), 0.3, training=self.training))


@pytest.mark.parametrize("left_in_eval", [True, False])
def test_eval_mode_is_found_where_only_functional_dropout_reads_the_flag(tmp_path, left_in_eval):
    model = _FunctionalDropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def each(step):
        if step == 3:
            model.eval()
            if not left_in_eval:
                model.train()
    _, found, _ = _train(tmp_path, model, opt, each=each)
    assert found == ({("eval_mode", 4)} if left_in_eval else set())


def test_a_frozen_submodule_in_eval_mode_is_silent(tmp_path):
    model = _FunctionalDropout()
    model.a.requires_grad_(False)
    opt = torch.optim.SGD(model.b.parameters(), lr=0.1)
    _, found, _ = _train(tmp_path, model, opt, each=lambda step: model.a.eval())
    assert found == set()


class _Distilled(nn.Module):
    """A student and a teacher with dropout (a submodule of the recorded model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.teacher = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x):
        return self.student(x) + self.teacher(x)


@pytest.mark.parametrize("frozen", [True, False])
def test_dropout_in_eval_mode_inside_a_frozen_teacher_is_silent(tmp_path, frozen):
    """A frozen teacher kept in eval mode is the distillation pattern; the same teacher in eval
    mode while it trains is eval_mode."""
    model = _Distilled()
    model.teacher.requires_grad_(not frozen)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _, found, _ = _train(tmp_path, model, opt, each=lambda step: model.teacher.eval())
    assert found == (set() if frozen else {("eval_mode", 0)})


# -- the recorder's own failures -------------------------------------------------------------------
def _broken(monkeypatch):
    from gradrepro.probe import probe

    def fail(self):
        raise ValueError("a failure of the probe itself")
    monkeypatch.setattr(probe.Probe, "collect", fail)


def test_a_failing_recorder_is_one_finding_and_training_goes_on(tmp_path, monkeypatch):
    _broken(monkeypatch)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    rec, found, warned = _train(tmp_path, model, opt, steps=9)
    assert found == {("recorder_error", 0)}
    assert "a failure of the probe itself" in rec.watch.found[0].detail and len(warned) == 1
    assert rec.step == 0 and rec.status == "completed"  # recording stopped at step 0; the run folder closed
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # all 9 steps trained


def test_a_failing_recorder_raises_when_asked(tmp_path, monkeypatch):
    _broken(monkeypatch)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="a failure of the probe itself"):
        _train(tmp_path, model, opt, on_finding="raise")


def test_a_lazy_module_is_recorded_from_its_first_step(tmp_path):
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec, found, warned = _train(tmp_path, model, opt, steps=6)
    assert found == set() and warned == [] and rec.step == 6
    modules = pd.read_parquet(tmp_path / "run" / "modules.parquet")
    assert sorted(modules["step"].unique()) == [0, 4]
    assert set(modules.loc[modules["step"] == 0, "grad_state"]) == {"finite"}
    assert len(modules[modules["step"] == 0]) == 4


def test_a_meta_device_model_trains_with_one_finding_and_no_error(tmp_path):
    model = nn.Linear(6, 3, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradrepro.record(model, opt, tmp_path / "run", every=1) as rec:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 6, device="meta")).sum().backward()
                opt.step()
    assert [f.kind for f in rec.watch.found] == ["recorder_error"] and "meta device" in rec.watch.found[0].detail
    assert len([w for w in caught if issubclass(w.category, TrainingFinding)]) == 1


# -- bad input: one line ------------------------------------------------------------------------------
def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_a_model_without_parameters_is_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        gradrepro.record(nn.ReLU(), None, tmp_path / "run", hooks=False)
    assert "no registered parameters" in _one_line(err)


def test_an_optimizer_over_another_model_is_one_line(tmp_path):
    model = nn.Linear(6, 3)
    with pytest.raises(UserError) as err:
        gradrepro.record(model, torch.optim.SGD(nn.Linear(6, 3).parameters(), lr=0.1), tmp_path / "run")
    assert "none is a parameter of this Linear" in _one_line(err)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_closed_recorder_logged_to_is_one_line(tmp_path):
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradrepro.record(model, opt, tmp_path / "run")
    rec.close()
    with pytest.raises(UserError) as err:
        rec.log(loss=1.0)
    assert "closed recorder" in _one_line(err)
    with pytest.raises(UserError) as err:
        rec.before_step()
    assert "closed recorder" in _one_line(err)


def test_on_finding_raise_stops_at_an_invariant(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(FindingError) as err:
        _train(tmp_path, model, opt, micro=2, reset=lambda step, i: opt.zero_grad(), on_finding="raise")
    assert err.value.findings[0].kind == "grad_reset_in_step"


# -- the update rule, live ------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd_dampening_maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
    "adam_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adamw_foreach_off": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_as_the_rule_predicts_are_silent(tmp_path, name):
    model = _mlp()
    _, found, _ = _train(tmp_path, model, OPTIMIZERS[name](model.parameters()), every=1, steps=6)
    assert found == set()


def test_a_gradient_changed_inside_the_step_is_an_update_mismatch(tmp_path):
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        # a pre-hook added after the recorder's: the step uses another gradient than the one it was given
        def flip(*_):
            for p in model[0].parameters():
                p.grad.mul_(-1.0)
        opt.register_step_pre_hook(flip)
        for _ in range(4):
            opt.zero_grad()
            x, y = _data()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    kinds = {(f.kind, f.step) for f in rec.watch.found}
    assert ("update_mismatch", 0) in kinds
    finding = next(f for f in rec.watch.found if f.kind == "update_mismatch")
    assert finding.evidence["tensors_mismatched"] == 2 and finding.name == "0.weight"


class _CountlessAdam(torch.optim.Adam):
    """Adam's step written out by hand, with its bias corrections at the count it finds plus one;
    ``advance`` False: the count is read and never written back (it stays 0)."""

    advance = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                t = float(state["step"]) + 1
                if self.advance:
                    state["step"] += 1
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))


@pytest.mark.parametrize("advance", [False, True])
def test_an_adam_step_count_never_advanced_is_an_update_mismatch(tmp_path, advance):
    """Each update matches Adam's rule for the state it found; the count the rule advances does not move."""
    model = _mlp()
    opt = _CountlessAdam(model.parameters(), lr=1e-2)
    opt.advance = advance
    rec, found, _ = _train(tmp_path, model, opt, every=4, steps=9)
    if advance:
        assert found == set()
    else:
        assert found == {("update_mismatch", 4)}
        finding = next(f for f in rec.watch.found if f.kind == "update_mismatch")
        assert finding.evidence["step_count_before"] == finding.evidence["step_count_after"] == 0


@pytest.mark.parametrize("zero_d", [False, True])
def test_a_step_with_no_backward_from_a_reset_gradient_is_stale(tmp_path, zero_d):
    """A second loss writes the recorded model's .grad between its steps (a generator's pass
    through a discriminator): the discriminator's step is stale only if nothing resets it."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 6), _mlp()
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    with gradrepro.record(disc, opt_d, tmp_path / "run", every=4, activations=False, on_finding="log") as rec:
        for _ in range(9):
            fake = gen(torch.randn(8, 4))
            if zero_d:
                opt_d.zero_grad()
            (disc(torch.randn(8, 6)).logsumexp(1).mean() - disc(fake.detach()).logsumexp(1).mean()).backward()
            opt_d.step()
            opt_g.zero_grad()
            disc(fake).logsumexp(1).mean().backward()
            opt_g.step()
    # without the reset, the tensors watched on every step see it at the first step it acts (1)
    assert {(f.kind, f.step) for f in rec.watch.found} == (set() if zero_d else {("stale_gradient", 1)})


def test_a_generator_pass_reset_before_the_discriminators_own_backward_is_not_a_lost_gradient(tmp_path):
    """The generator's backward runs through the recorded discriminator and writes its .grad;
    the discriminator's zero_grad() then rightly drops that by-product before its own backward
    (the backward flowed on into the discriminator's input, the generator's output). A reset
    between two micro-batches of a model's own loss stays grad_reset_in_step (the tests above)."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 6), _mlp()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
    with gradrepro.record(disc, opt_d, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        for _ in range(6):
            z = torch.randn(8, 4)
            disc(gen(z)).logsumexp(1).mean().backward()  # the generator's pass
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()  # drop the by-product
            (disc(torch.randn(8, 6)).logsumexp(1).mean() - disc(gen(z).detach()).logsumexp(1).mean()).backward()
            opt_d.step()
            opt_d.zero_grad()
    assert rec.watch.found == []


class _LocalStages(nn.Module):
    """Local learning: the first stage's own loss is back-propagated inside forward(), and the
    second stage gets a detached input."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1, self.aux = nn.Linear(6, 8), nn.Linear(8, 3)
        self.stage2 = nn.Linear(8, 3)
        self.target = None

    def forward(self, x):
        h = torch.relu(self.stage1(x))
        F.cross_entropy(self.aux(h), self.target).backward()
        return self.stage2(h.detach())


def test_a_backward_inside_the_forward_pass_is_not_a_carried_gradient(tmp_path):
    """zero_grad() before the forward pass, whose own backward writes the first stage's .grad
    before the backward the recorder sees begins: made in this step, nothing carried in."""
    torch.manual_seed(0)
    model = _LocalStages()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradrepro.record(model, opt, tmp_path / "run", every=2, activations=False, on_finding="log") as rec:
        for _ in range(6):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            model.target = y
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert rec.watch.found == []


def test_steps_a_grad_scaler_skips_while_its_scale_settles_are_silent(tmp_path):
    """A scale so large that the first backward passes overflow: the scaler skips those steps and
    the loop zeroes their non-finite gradients, as it must."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0e38)
    with gradrepro.record(model, opt, tmp_path / "run", every=1, activations=False, scaler=scaler,
                          on_finding="log") as rec:
        for _ in range(8):
            opt.zero_grad()
            x, y = _data()
            scaler.scale(F.cross_entropy(model(x), y) * 100).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() < 3.0e38  # steps were skipped
    assert rec.watch.found == []


def test_an_unknown_option_is_one_line_naming_the_options(tmp_path):
    with pytest.raises(UserError) as err:
        gradrepro.record(nn.Linear(6, 3), None, tmp_path / "run", hooks=False, evry=5)
    message = _one_line(err)
    assert "'evry' is not an option" in message and "every" in message and "on_finding" in message
    assert not (tmp_path / "run").exists()


def test_a_bad_option_value_is_one_line_before_any_folder(tmp_path):
    with pytest.raises(UserError) as err:
        gradrepro.record(nn.Linear(6, 3), None, tmp_path / "run", hooks=False, on_finding="shout")
    assert "on_finding" in _one_line(err)
    assert not (tmp_path / "run").exists()


# -- the options: one documented dataclass ---------------------------------------------------------------
def test_the_options_are_one_dataclass_and_keywords_replace_its_fields(tmp_path):
    from gradrepro.record import RecordOptions

    options = RecordOptions(every=3, on_finding="log", live=False)
    model = nn.Linear(6, 3)
    rec = gradrepro.record(model, None, tmp_path / "a", options=options, hooks=False)
    assert (rec.options.every, rec.options.on_finding, rec.options.hooks, rec.watch) == (3, "log", False, None)
    rec.close()
    rec = gradrepro.record(model, None, tmp_path / "b", 5, options=options, hooks=False)
    assert rec.options.every == 5 and rec.every == 5 and options.every == 3  # the given options are not changed
    rec.close()


def test_every_option_is_documented_under_args():
    import dataclasses

    from gradrepro.record import RecordOptions

    args = RecordOptions.__doc__.split("Args:", 1)[1]
    documented = {line.strip().split(":", 1)[0] for line in args.splitlines() if line.startswith(" " * 8 + "")
                  and not line.startswith(" " * 12) and ":" in line}
    assert documented == {f.name for f in dataclasses.fields(RecordOptions)}


class _LookedUpFrozen(nn.Module):
    """A frozen embedding table (pretrained vectors) with ``max_norm``, and a trained head."""

    def __init__(self, max_norm) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(20, 6, max_norm=max_norm)
        with torch.no_grad():
            self.table.weight.mul_(3.0)  # rows above the max norm
        self.table.weight.requires_grad_(False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.table((x.abs() * 3).long().clamp(max=19)).mean(1))


@pytest.mark.parametrize("max_norm", [1.0, None])
def test_a_frozen_table_renormalised_in_the_forward_pass_is_found(tmp_path, max_norm):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place during the forward
    pass, frozen or not: ``frozen_moved`` inside the step; without ``max_norm`` nothing."""
    model = _LookedUpFrozen(max_norm)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    rec, found, _ = _train(tmp_path, model, opt)
    if max_norm is None:
        assert found == set()
    else:
        assert ("frozen_moved", 0) in found
        finding = next(f for f in rec.watch.found if f.kind == "frozen_moved")
        assert finding.name == "table.weight" and "inside the step" in finding.detail


def test_a_momentum_encoder_updated_in_the_forward_pass_is_information(tmp_path):
    """MoCo's key encoder, updated by momentum inside ``forward`` (He et al. 2020, m = 0.999):
    ``target_network_update`` inside the step, no warning."""
    class MoCoLike(_WithTarget):
        def forward(self, x):
            with torch.no_grad():
                for t, o in zip(self.target.parameters(), self.online.parameters()):
                    t.mul_(0.999).add_(o, alpha=0.001)
            return super().forward(x)
    model = MoCoLike()
    rec, found, _ = _train(tmp_path, model, torch.optim.SGD(model.online.parameters(), lr=0.1, momentum=0.9))
    assert {k for k, _ in found} == {"target_network_update"}
