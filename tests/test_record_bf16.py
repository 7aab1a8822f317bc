"""What bf16 rounds away: per module, the share of the entries the gradient reached whose
update is smaller than half a bf16 unit in the last place of the weight (frac_bf16_update_lost),
against float64 on constructed updates; measured by itself under bf16 autocast and with bf16
weights, not otherwise."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradrepro

torch.set_num_threads(1)


def constructed(dtype, seed=0):
    """A linear layer's weights over 2^-10..2^10 (a few exact zeros) and gradients from 2^-14 to
    2^-2 of them (a few exact zeros), none within 2% of half an ulp: float64 decides each."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp2(torch.rand(64, 32, generator=g, dtype=torch.float64) * 20 - 10)
    w *= torch.where(torch.rand(64, 32, generator=g) < 0.5, -1.0, 1.0).double()
    w[0, :4] = 0.0
    w = w.to(dtype).double()  # representable in the weight's dtype
    ratio = torch.exp2(torch.rand(64, 32, generator=g, dtype=torch.float64) * -12 - 2)
    grad = (w.abs().clamp(min=1e-3) * ratio).to(dtype).double()
    grad[1, :6] = 0.0
    half_ulp = half_ulp_bf16(w)
    near = (grad - half_ulp).abs() < 0.02 * half_ulp
    grad[near] *= 1.1
    return w, grad.to(dtype).double()


def half_ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """In float64: half a unit in the last place of x in bf16 (8 significant bits), 0 for x == 0."""
    _, exponent = np.frexp(x.numpy())  # x = m 2^e, 0.5 <= |m| < 1: floor(log2|x|) = e - 1
    return torch.from_numpy(np.where(x.numpy() == 0, 0.0, np.ldexp(1.0, exponent - 1 - 8)))


def step_once(dtype, tmp_path, **options):
    """One SGD step of lr 1 with the constructed gradient: the update is the gradient."""
    w, grad = constructed(dtype)
    layer = nn.Linear(32, 64, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    rec = gradrepro.record(layer, opt, tmp_path / "run", every=1, activations=False, **options)
    layer.weight.grad = grad.to(dtype)
    opt.step()
    after = layer.weight.detach().double()
    rec.close()
    row = pd.read_parquet(tmp_path / "run" / "modules.parquet").iloc[0]
    return w, grad, after, row


def test_fp32_weights_count_the_updates_bf16_weights_would_drop(tmp_path):
    w, grad, after, row = step_once(torch.float32, tmp_path, bf16=True)
    reached = grad != 0
    lost = reached & ((w - after).abs() < half_ulp_bf16(after))  # float64, on the applied update
    assert 0.1 < lost.sum() / reached.sum() < 0.9  # the construction puts entries on both sides
    assert row["frac_bf16_update_lost"] == pytest.approx(int(lost.sum()) / int(reached.sum()), abs=0)


def test_bf16_weights_keep_as_zero_exactly_the_updates_below_half_an_ulp(tmp_path):
    w, grad, after, row = step_once(torch.bfloat16, tmp_path)  # measured by itself: the weights are bf16
    reached = grad != 0
    predicted = reached & (grad.abs() < half_ulp_bf16(w))  # float64, from the weight before the step
    unchanged = reached & (after == w)
    assert torch.equal(predicted, unchanged)  # what bf16 did: the rounded-away updates are exactly these
    assert row["frac_bf16_update_lost"] == pytest.approx(int(predicted.sum()) / int(reached.sum()), abs=0)


def test_bf16_autocast_turns_the_count_on_and_fp32_leaves_it_off(tmp_path):
    def run(name, autocast):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        with gradrepro.record(model, opt, tmp_path / name, every=1):
            for _ in range(2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
        return pd.read_parquet(tmp_path / name / "modules.parquet")["frac_bf16_update_lost"]

    assert run("bf16", True).between(0, 1).all()
    assert run("fp32", False).isna().all()
