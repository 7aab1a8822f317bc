"""gradrepro.record with optimizers as users configure them: fused and foreach implementations
record the same statistics; a parameter group added after the recorder starts is recorded as
updated from then on; zero_grad(set_to_none) either way records the same; with a GradScaler
the gradients recorded are the unscaled ones the optimizer steps with, clipped or not."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro

torch.set_num_threads(1)
STEPS = 4
COMPARED = ("grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]


def run(tmp_path, name, make_opt, set_to_none=True, scaler=None, clip=None, clip_before_unscale=False):
    model = mlp()
    opt = make_opt(model.parameters())
    with gradrepro.record(model, opt, tmp_path / name, every=1, scaler=scaler) as rec:
        for x, y in batches():
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
                continue
            scaler.scale(loss).backward()
            if clip is not None and clip_before_unscale:
                nn.utils.clip_grad_norm_(model.parameters(), clip)  # the mistake: clips scaled gradients
            scaler.unscale_(opt)
            if clip is not None and not clip_before_unscale:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
    return (pd.read_parquet(tmp_path / name / "modules.parquet"),
            pd.read_parquet(tmp_path / name / "scalars.parquet"), {f.kind for f in rec.findings()})


def assert_same(a, b):
    for column in COMPARED:  # float rounding: the implementations sum in other orders
        np.testing.assert_allclose(a[column], b[column], rtol=1e-5, atol=1e-8, err_msg=column)


@pytest.mark.parametrize("make", [
    lambda **k: (lambda ps: torch.optim.Adam(ps, lr=1e-2, **k)),
    lambda **k: (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **k)),
    lambda **k: (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **k)),
], ids=["adam", "adamw", "sgd"])
def test_fused_and_foreach_record_the_same(tmp_path, make):
    fused, _, _ = run(tmp_path, "fused", make(fused=True))
    foreach, _, _ = run(tmp_path, "foreach", make(foreach=True))
    assert (foreach["update_to_param"] > 0).all()
    assert_same(fused, foreach)


def test_set_to_none_either_way_records_the_same(tmp_path):
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    none, _, _ = run(tmp_path, "none", sgd, set_to_none=True)
    zeros, _, _ = run(tmp_path, "zeros", sgd, set_to_none=False)
    assert_same(none, zeros)
    np.testing.assert_allclose(zeros["fresh_grad_norm"], none["grad_norm"], rtol=1e-6)


def test_a_parameter_group_added_after_the_recorder_starts_is_updated_from_then_on(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "late", every=1) as rec:
        for step, (x, y) in enumerate(batches()):
            if step == 2:
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.1})
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        findings = rec.findings()
    found = {(f.kind, f.name) for f in findings}
    modules = pd.read_parquet(tmp_path / "late" / "modules.parquet")
    late = modules[modules["module"] == "2"]
    assert (late[late["step"] < 2]["update_to_param"] == 0).all()
    assert (late[late["step"] >= 2]["update_to_param"] > 0).all()
    # Held by the optimizer now: said only as the live finding of the steps before (step < 2).
    outside = [f for f in findings if (f.kind, f.name) == ("not_in_optimizer", "2.weight")]
    assert all(getattr(f, "step", None) is not None and 0 <= f.step < 2 for f in outside)
    assert ("not_updated", "2.weight") in found  # the steps before it was: said, as a finding


def test_with_a_grad_scaler_the_record_is_of_the_unscaled_gradients_the_optimizer_uses(tmp_path):
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    plain, plain_scalars, _ = run(tmp_path, "plain", sgd)
    # The scale doubles after every step (no step overflows here): a clip before unscaling
    # is then told apart from one after it (diagnose/scaled_clip.py).
    scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)  # noqa: E731
    unclipped, _, _ = run(tmp_path, "scaled", sgd, scaler=scaler(), clip=1e6)
    assert_same(unclipped, plain)  # the scale is gone: the same gradients as without a scaler
    clip = 0.05  # below every step's gradient norm (checked below): the clip acts
    assert (plain_scalars["grad_norm"] > clip).all()
    _, after, after_found = run(tmp_path, "after", sgd, scaler=scaler(), clip=clip)
    np.testing.assert_allclose(after["grad_norm"], clip, rtol=1e-5)  # what the optimizer used: clipped
    assert "clipped_while_scaled" not in after_found
    _, before, before_found = run(tmp_path, "before", sgd, scaler=scaler(), clip=clip, clip_before_unscale=True)
    # Clipped while scaled, then unscaled: the optimizer steps with clip / scale, and so reads the record.
    np.testing.assert_allclose(before["grad_norm"], clip / before["loss_scale"], rtol=1e-5)
    assert before["loss_scale"].nunique() == STEPS
    assert "clipped_while_scaled" in before_found  # and it is a finding
