"""Two live checks of ``gradrepro.record`` that hold between logged steps too:
``stale_gradient`` from the few tensors watched on every step (``watch.carried``), and
``optimizer_attribute``, a hyper-parameter assigned on the optimizer object (``watch.checks``).
Each is shown on its bug and silent on the loop that fixes it."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro
from gradrepro.watch.carried import SAMPLED
from gradrepro.watch.checks import setting_hits


def _data(n: int = 16):
    return torch.randn(n, 6), torch.randint(0, 3, (n,))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _run(tmp_path, body, every: int = 8, steps: int = 24, opt=None, model=None):
    model = model or _mlp()
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    with gradrepro.record(model, opt, tmp_path / "run", every=every, activations=False, on_finding="log") as rec:
        for i in range(steps):
            body(i, model, opt)
    return rec


def _kinds(rec) -> set:
    return {(f.kind, f.step) for f in rec.watch.found}


@pytest.mark.parametrize("buggy", [True, False])
def test_a_reset_every_k_steps_aliased_with_the_logging_period_is_stale_at_once(tmp_path, buggy):
    """zero_grad() every 4 micro-batches, step() on every one: each logged step (every 8) falls
    right after a reset, so only the tensors watched on every step see the carried sums."""
    def body(i, model, opt):
        if (i % 4 == 0) if buggy else True:
            opt.zero_grad()
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rec = _run(tmp_path, body)
    assert _kinds(rec) == ({("stale_gradient", 1)} if buggy else set())
    if buggy:
        assert rec.watch.found[0].evidence["tensors_carrying"] == rec.watch.found[0].evidence["tensors_watched"]


@pytest.mark.parametrize("reset", ["set_to_none", "zeros", "data_zero"])
def test_every_way_of_resetting_a_gradient_reads_as_reset(tmp_path, reset):
    """zero_grad()'s default (None), zero_grad(set_to_none=False) (zeroed in place: a new
    version) and the old p.grad.data.zero_() (zeroed without a new version: the non-zero test)."""
    def body(i, model, opt):
        if reset == "data_zero":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
        else:
            opt.zero_grad(set_to_none=reset == "set_to_none")
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert _kinds(_run(tmp_path, body)) == set()


def test_a_reset_of_one_part_leaves_the_other_stale(tmp_path):
    """zero_grad() on the head only: the body's tensors carry the sums (the watched tensors
    are spread over the optimizer's list, so both parts have some)."""
    def body(i, model, opt):
        model[4].zero_grad()
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rec = _run(tmp_path, body)
    stale = [f for f in rec.watch.found if f.kind == "stale_gradient"]
    assert [f.step for f in stale] == [1]
    assert "0.weight" in stale[0].detail and "4.weight" not in stale[0].detail
    assert 0 < stale[0].evidence["tensors_carrying"] < stale[0].evidence["tensors_watched"]


def test_gradient_accumulation_with_the_reset_at_the_step_is_silent(tmp_path):
    def body(i, model, opt):
        for _ in range(3):
            x, y = _data(8)
            (F.cross_entropy(model(x), y) / 3).backward()
        opt.step()
        opt.zero_grad()
    assert _kinds(_run(tmp_path, body)) == set()


def test_the_watched_tensors_are_few_and_their_hooks_go_with_the_recorder(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])  # 24 tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradrepro.record(model, opt, tmp_path / "run", every=4, activations=False) as rec:
        watched = rec.watch.carried.sampled
        assert len(watched) == SAMPLED and watched[0] == 0 and watched[-1] == 23
        assert sum(bool(p._backward_hooks) for p in model.parameters()) == SAMPLED
    assert not any(p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize("buggy", [True, False])
def test_a_learning_rate_assigned_on_the_optimizer_object_is_reported(tmp_path, buggy):
    """A hand-written decay that assigns optimizer.lr (an attribute the step never reads) against
    one that assigns each param group's lr."""
    def body(i, model, opt):
        if i == 10:
            if buggy:
                opt.lr = 0.005
            else:
                for g in opt.param_groups:
                    g["lr"] = 0.005
        opt.zero_grad()
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    rec = _run(tmp_path, body)
    assert _kinds(rec) == ({("optimizer_attribute", 16)} if buggy else set())
    if buggy:
        finding = rec.watch.found[0]
        assert finding.name == "<optimizer>.lr" and "0.05" in finding.detail and "param_groups" in finding.fix


def _torch_optimizers():
    return [cls for _, cls in inspect.getmembers(torch.optim, inspect.isclass)
            if issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer]


@pytest.mark.parametrize("cls", _torch_optimizers(), ids=lambda c: c.__name__)
def test_no_torch_optimizer_holds_a_default_as_an_attribute(cls):
    params = [nn.Parameter(torch.randn(4, 4))]
    try:
        opt = cls(params, lr=0.01)
    except (TypeError, ValueError) as exc:  # an optimizer that wants other arguments
        pytest.skip(str(exc))
    assert setting_hits(opt) == []
    opt.lr = 0.5
    assert [h[0] for h in setting_hits(opt)] == ["optimizer_attribute"]


def test_a_subclass_that_reads_its_own_attribute_is_left_alone():
    class ScaledSGD(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            self.lr = lr  # read by its own step

        def step(self, closure=None):
            for g in self.param_groups:
                g["lr"] = self.lr
            return super().step(closure)

    assert setting_hits(ScaledSGD([nn.Parameter(torch.randn(2))], lr=0.1)) == []


def _poisoned_batch(i: int, at: int):
    x, y = _data()
    if i == at:
        x[0, 0] = float("nan")  # one corrupt sample: every gradient of this backward is NaN
    return x, y


@pytest.mark.parametrize("buggy", [True, False])
def test_a_skipped_step_whose_nan_gradient_is_never_reset_is_stale(tmp_path, buggy):
    """The loop skips optimizer.step() when the gradient norm is not finite; on the skip path
    it forgets zero_grad(), so every later backward adds onto NaN and every later step is
    skipped (the fix resets there). Found at the step in progress, before any later log."""
    def body(i, model, opt):
        x, y = _poisoned_batch(i, at=5)
        F.cross_entropy(model(x), y).backward()
        if not torch.isfinite(nn.utils.clip_grad_norm_(model.parameters(), 5.0)):
            if not buggy:
                opt.zero_grad()
            return
        opt.step()
        opt.zero_grad()
    rec = _run(tmp_path, body, steps=16)
    assert _kinds(rec) == ({("stale_gradient", 5)} if buggy else set())
    if buggy:
        assert rec.watch.found[0].evidence == {"forward_passes": 2, "most_passes_of_a_step": 1}


def test_an_overflow_carried_within_an_accumulated_step_is_silent(tmp_path):
    """Three micro-batches a step; the first micro-batch of one step overflows and the next two
    add onto it (as a GradScaler's accumulation does), then the step is skipped and reset."""
    def body(i, model, opt):
        for k in range(3):
            x, y = _poisoned_batch(3 * i + k, at=15)
            (F.cross_entropy(model(x), y) / 3).backward()
        if torch.isfinite(nn.utils.clip_grad_norm_(model.parameters(), 5.0)):
            opt.step()
        opt.zero_grad()
    assert _kinds(_run(tmp_path, body, steps=10)) == set()


@pytest.mark.parametrize("buggy", [True, False])
def test_a_sparse_gradient_is_read_through_its_values(tmp_path, buggy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    opts = [torch.optim.SparseAdam(list(model[0].parameters()), lr=0.01),
            torch.optim.Adam(list(model[2].parameters()), lr=0.01)]
    with gradrepro.record(model, opts, tmp_path / "run", every=8, activations=False, on_finding="log") as rec:
        for _ in range(6):
            if not buggy:
                for opt in opts:
                    opt.zero_grad()
            F.cross_entropy(model(torch.randint(0, 20, (8, 3))), torch.randint(0, 3, (8,))).backward()
            for opt in opts:
                opt.step()
    kinds = {f.kind for f in rec.watch.found}
    assert "recorder_error" not in kinds
    assert ("stale_gradient" in kinds) == buggy


# -- another optimizer's step (watch.carried, its module docstring's second part) ------------------
def _other_optimizer_run(tmp_path, order: str, steps: int = 6):
    """A model held by the recorded optimizer, its first layer also by a second Adam stepped after
    one backward (``order``: "after" or "before" the recorded one; "none": never)."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    second = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    with gradrepro.record(model, opt, tmp_path / "run", every=4, activations=False, on_finding="log") as rec:
        for _ in range(steps):
            opt.zero_grad()
            second.zero_grad()
            x, y = _data()
            F.cross_entropy(model(x), y).backward()
            if order == "before":
                second.step()
            opt.step()
            if order == "after":
                second.step()
    return rec


@pytest.mark.parametrize("order", ["after", "before", "none"])
def test_one_gradient_stepped_by_two_optimizers_is_found_at_its_first_step(tmp_path, order):
    rec = _other_optimizer_run(tmp_path, order)
    found = [f for f in rec.watch.found if f.kind == "changed_between_steps" and "another optimizer" in f.detail]
    if order == "none":
        assert _kinds(rec) == set()
    else:
        assert [f.step for f in found] == [0]
        assert found[0].evidence["other_optimizer"] == "Adam" and found[0].name == "0.weight"
        assert f"optimizer's step 0 used, {order} it" in found[0].detail


class _Wrapper(torch.optim.Optimizer):
    """An optimizer whose step runs an inner one over the same tensors (as Lookahead or a loss-scaling
    wrapper do): one step of one rule, not two optimizers."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {"lr": inner.defaults["lr"]})

    @torch.no_grad()
    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.parametrize("recorded", ["wrapper", "inner"])
def test_a_wrapper_around_the_recorded_optimizer_or_inside_it_is_not_another_optimizer(tmp_path, recorded):
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapper = _Wrapper(inner)

    def body(i, model, opt):
        wrapper.zero_grad()
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        wrapper.step()
    rec = _run(tmp_path, body, opt=wrapper if recorded == "wrapper" else inner, model=model, steps=8)
    assert _kinds(rec) == set()


def test_an_optimizer_switched_for_another_mid_run_is_not_two_optimizers(tmp_path):
    """Adam for the first steps, then SGD over the same tensors (the recorded Adam steps no more)."""
    model = _mlp()
    adam, sgd = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.SGD(model.parameters(), lr=0.05)

    def body(i, model, opt):
        current = adam if i < 4 else sgd
        current.zero_grad()
        x, y = _data()
        F.cross_entropy(model(x), y).backward()
        current.step()
    assert _kinds(_run(tmp_path, body, opt=adam, model=model, steps=10)) == set()


def _gan(tmp_path, loop: str, steps: int = 8):
    """A GAN with the discriminator recorded. ``loop``: "buggy" (the generator's backward fills the
    discriminator's .grad, nothing zeroes it before the discriminator's own backward); "fixed"
    (zero_grad() before it); "zeros" (the same with zero_grad(set_to_none=False)); "paused" (the
    discriminator steps only on even iterations, zeroing before its own backward)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=5e-3), torch.optim.Adam(disc.parameters(), lr=5e-3)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    with gradrepro.record(disc, opt_d, tmp_path / "run", every=4, activations=False, on_finding="log") as rec:
        for step in range(steps):
            z = torch.randn(32, 4)
            F.binary_cross_entropy_with_logits(disc(gen(z)), ones).backward()
            opt_g.step()
            opt_g.zero_grad()
            if loop == "paused" and step % 2:
                continue
            if loop != "buggy":
                opt_d.zero_grad(set_to_none=loop != "zeros")
            real = torch.randn(32, 2) + 2
            (F.binary_cross_entropy_with_logits(disc(real), ones)
             + F.binary_cross_entropy_with_logits(disc(gen(z).detach()), zeros)).backward()
            opt_d.step()
            opt_d.zero_grad()
    return rec


@pytest.mark.parametrize("loop", ["buggy", "fixed", "zeros", "paused"])
def test_a_discriminator_stepped_with_the_generator_loss_gradient_is_stale_at_its_first_step(tmp_path, loop):
    rec = _gan(tmp_path, loop)
    if loop == "buggy":
        stale = [f for f in rec.watch.found if f.kind == "stale_gradient"]
        assert [f.step for f in stale] == [0] and stale[0].evidence["other_optimizer"] == "Adam"
    else:
        assert _kinds(rec) == set()


def test_closing_the_recorder_removes_its_hooks_on_every_optimizer(tmp_path):
    from torch.optim import optimizer as torch_optimizer
    before = (len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks))
    rec = _other_optimizer_run(tmp_path, "none", steps=2)
    assert rec.watch.found == []
    assert (len(torch_optimizer._global_optimizer_pre_hooks),
            len(torch_optimizer._global_optimizer_post_hooks)) == before


def test_a_recorder_never_closed_stops_listening_to_optimizers_once_collected(tmp_path):
    """The hooks on every optimizer's step hold the checks weakly: a recorder dropped without
    close() is not called at every later optimizer step of the process."""
    import gc
    import weakref

    from torch.optim import optimizer as torch_optimizer

    from gradrepro.watch import carried

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = gradrepro.record(model, opt, tmp_path / "run", every=4, activations=False, on_finding="log")
    x, y = _data()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    check = weakref.ref(rec.watch.carried)
    assert check() in set(carried._LISTENING)
    hooks = carried.own_global_hooks()
    assert hooks and hooks <= set(torch_optimizer._global_optimizer_pre_hooks) | set(
        torch_optimizer._global_optimizer_post_hooks)
    del rec, model, opt
    gc.collect()
    assert check() is None
    # the last check gone, the pair of global hooks is gone too (another live test's could remain)
    if not list(carried._LISTENING):
        assert carried.own_global_hooks() == set()
        assert not hooks & (set(torch_optimizer._global_optimizer_pre_hooks)
                            | set(torch_optimizer._global_optimizer_post_hooks))
