"""The probe's fast reductions against the plain torch ops they replace: the zero and
fp16-flush counts (``count_nonzero``, ``abs() <= FP16_FLUSH``) and the activation std
(``torch.var_mean``), including NaN, inf, exact-threshold and subnormal entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gradrepro import probe as probe_mod
from gradrepro.config import ProbeConfig
from gradrepro.probe import (
    FP16_FLUSH,
    Probe,
    _grad_level_sums,
    _std,
    counts_from_level_sums,
    level_sums,
    mean_ssd,
)


def reference_counts(x: torch.Tensor):
    return x.numel() - int(torch.count_nonzero(x)), int((x.abs() <= FP16_FLUSH).sum())


def awkward(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-12, 2, (n,), generator=g)
    x[torch.rand(n, generator=g) < 0.2] = 0.0
    special = torch.tensor([FP16_FLUSH, -FP16_FLUSH, FP16_FLUSH * 1.0000001, 2.0**-24,
                            1e-45, -0.0, float("nan"), float("inf"), -float("inf"), 3e38])
    x[: len(special)] = special
    return x


@pytest.mark.parametrize("seed", range(4))
def test_level_sums_give_the_exact_zero_and_flush_counts(seed):
    x = awkward(5000, seed)
    s1, s2 = level_sums(x).tolist()
    assert counts_from_level_sums(x.numel(), s1, s2) == reference_counts(x)


@pytest.mark.parametrize("seed", range(2))
def test_scratch_buffer_gives_the_same_sums_and_leaves_the_input_alone(seed):
    x = awkward(5000, seed).reshape(50, 100)
    before = x.clone()
    scratch = torch.full((x.numel(),), 7.0)
    assert torch.equal(level_sums(x, scratch), level_sums(x))
    y = torch.relu(torch.randn(50, 100)) + 3.0
    torch.testing.assert_close(mean_ssd(y, scratch), mean_ssd(y), rtol=0, atol=0)
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())


def test_level_sums_exact_on_the_float64_path(monkeypatch):
    monkeypatch.setattr(probe_mod, "_EXACT_F32", 100)
    x = awkward(3000, 7).reshape(30, 100)
    s1, s2 = level_sums(x).tolist()
    assert counts_from_level_sums(x.numel(), s1, s2) == reference_counts(x)


def test_chunked_foreach_level_sums_match_per_tensor(monkeypatch):
    monkeypatch.setattr(probe_mod, "_EXACT_F32", 2500)  # several chunks and one big tensor
    tensors = [awkward(n, i).abs_().nan_to_num_(0.0, 1.0, 1.0) for i, n in
               enumerate([700, 900, 1200, 4000, 50, 2400])]
    for got, x in zip(_grad_level_sums(tensors), tensors):
        s1, s2 = got.tolist()
        assert counts_from_level_sums(x.numel(), s1, s2) == reference_counts(x)


def test_mean_ssd_matches_var_mean():
    x = torch.relu(torch.randn(8, 16, 5, 5)) + 3.0
    mean, ssd = mean_ssd(x).double().numpy()
    var, ref_mean = torch.var_mean(x.double())
    assert mean == pytest.approx(ref_mean.item(), rel=1e-6)
    assert _std(np.array(ssd), np.array(float(x.numel()))) == pytest.approx(
        var.sqrt().item(), rel=1e-5)


def test_activation_gradient_columns_match_hand_computation():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(10, 4)
    h = net[0](x)
    h.retain_grad()
    out = net[2](net[1](h))
    out.retain_grad()
    (out.pow(2).sum() * 1e-9).backward()  # small gradients: some flush in fp16, some zero
    grads = {"0": h.grad, "2": out.grad}
    net.zero_grad()
    probe = Probe(net, ProbeConfig(every=1, act_sample=1000), total_steps=1)
    probe.arm()
    (net(x).pow(2).sum() * 1e-9).backward()
    probe.collect()
    probe.disarm()
    cols = probe.after_step(0)
    for i, module in enumerate(cols["module"]):
        g = grads[module]
        zeros, small = reference_counts(g)
        nonzero = g.numel() - zeros
        assert cols["act_grad_std"][i] == pytest.approx(g.std().item(), rel=1e-5)
        assert cols["act_grad_frac_zero"][i] == pytest.approx(zeros / g.numel())
        expected = (small - zeros) / nonzero if nonzero else float("nan")
        np.testing.assert_allclose(cols["act_grad_frac_fp16_underflow"][i], expected)
    # the hidden layer's gradient has ReLU zeros: the case is not vacuous
    assert cols["act_grad_frac_zero"][list(cols["module"]).index("0")] > 0
