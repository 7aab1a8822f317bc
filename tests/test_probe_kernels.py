"""The probe's fast reductions against the plain torch ops they replace: the zero and
fp16-flush counts (``count_nonzero``, ``abs() <= FP16_FLUSH``) and the activation std
(``torch.var_mean``), including NaN, inf, exact-threshold and subnormal entries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradrepro.config.schema import ProbeConfig
from gradrepro.probe import FP16_FLUSH, Probe
from gradrepro.probe import kernels as probe_mod
from gradrepro.probe.kernels import (
    _grad_sums,
    _std,
    counts_from_level_sums,
    grad_std_from_sums,
    level_sums,
    mean_ssd,
    mean_ssd_host,
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


@pytest.mark.parametrize("reuse", [False, True])
def test_chunked_gradient_sums_match_per_tensor(monkeypatch, reuse):
    monkeypatch.setattr(probe_mod, "_EXACT_F32", 2500)  # several chunks and one big tensor
    tensors = [awkward(n, i).nan_to_num_(0.0, 1.0, -1.0) for i, n in
               enumerate([700, 900, 1200, 4000, 50, 2400])]
    before = [t.clone() for t in tensors]
    buffer = torch.full((2500,), 7.0)
    sums = _grad_sums(tensors, (lambda n: buffer[:n]) if reuse else None)
    assert sums.shape == (3, len(tensors)) and sums.dtype == torch.float64
    for (total, s1, s2), x, x0 in zip(sums.T.tolist(), tensors, before):
        assert counts_from_level_sums(x.numel(), s1, s2) == reference_counts(x)
        assert total == pytest.approx(x.double().sum().item(), rel=1e-5, abs=1e-30)
        assert torch.equal(x, x0)  # the gradients themselves are not touched


def test_gradient_std_from_norm_and_sum_where_accurate_else_recounted():
    g = torch.Generator().manual_seed(0)
    centred = torch.randn(100_000, generator=g) * 1e-3 + 0.9e-3  # |mean| just under std
    shifted = torch.randn(100_000, generator=g) * 1e-6 + 1.0  # a large mean, a tiny spread
    zeros = torch.zeros(64)
    vanishing = torch.randn(1000, generator=g) * 1e-22  # squares below float32's normal range
    xs = [centred, shifted, zeros, torch.tensor([3.0]), vanishing]
    norm = np.array([x.norm().item() for x in xs])
    total = np.array([x.sum().item() for x in xs])
    numel = np.array([float(x.numel()) for x in xs])
    n_zero = np.array([float(x.numel() - torch.count_nonzero(x)) for x in xs])
    std = grad_std_from_sums(norm, total, numel, n_zero)
    assert std[0] == pytest.approx(centred.double().std().item(), rel=1e-5)
    # There the one-pass formula cancels: it would be far off, so it must be left to the recount.
    with np.errstate(invalid="ignore"):
        one_pass = np.sqrt(max((norm[1] ** 2 - total[1] ** 2 / numel[1]) / (numel[1] - 1), 0.0))
    assert abs(one_pass / shifted.double().std().item() - 1) > 0.01
    assert np.isnan(std[1])
    assert std[2] == 0.0 and np.isnan(std[3]) and np.isnan(std[4])


def test_collect_recounts_the_std_of_a_gradient_with_a_large_mean():
    torch.manual_seed(0)
    net = nn.Linear(50, 40)
    probe = Probe(net, ProbeConfig(every=1), total_steps=1)
    with probe.step(0) as p:
        net(torch.randn(8, 50)).sum().backward()
        net.weight.grad = torch.randn(40, 50) * 1e-6 + 1.0  # what a debugger must still get right
        p.collect()
    cols = p.columns
    for i, name in enumerate(cols["param"]):
        ref = getattr(net, name).grad.double().std().item()
        assert cols["grad_std"][i] == pytest.approx(ref, rel=1e-4)


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
    with probe.step(0) as p:
        (net(x).pow(2).sum() * 1e-9).backward()
        p.collect()
    cols = p.columns
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


def test_mean_ssd_host_takes_one_pass_only_where_it_is_accurate():
    g = torch.Generator().manual_seed(3)
    relu = torch.relu(torch.randn(64, 32, 8, 8, generator=g)) * 3.0  # mean^2 < var: one pass
    collapsed = 1000.0 + 1e-3 * torch.randn(64, 256, generator=g)  # mean^2 >> var: two passes
    for x in (relu, collapsed, torch.zeros(10, 10)):
        x64 = x.double()
        ref_ssd = ((x64 - x64.mean()) ** 2).sum().item()
        mean, ssd = mean_ssd_host(x, torch.empty(x.numel()))
        assert (mean, ssd) == mean_ssd_host(x)  # the scratch buffer changes nothing
        assert mean == pytest.approx(x64.mean().item(), rel=1e-6)
        assert ssd == pytest.approx(ref_ssd, rel=1e-4, abs=0.0)
    # the case the fallback exists for: one pass alone would be far off there
    n, m = collapsed.numel(), collapsed.double().mean().item()
    one_pass = torch.dot(collapsed.reshape(-1), collapsed.reshape(-1)).item() - n * m * m
    ref = ((collapsed.double() - m) ** 2).sum().item()
    assert abs(one_pass / ref - 1) > 0.5
    nan = torch.tensor([1.0, float("nan"), 2.0])
    assert all(math.isnan(v) for v in mean_ssd_host(nan))
    assert all(math.isnan(v) for v in mean_ssd_host(torch.ones(0)))


def test_activation_gradient_counts_are_exact_with_nan_and_inf_in_the_gradient():
    # the hook skips its NaN pass only when the sample's mean is finite: here it is not
    net = nn.Sequential(nn.Linear(3, 400))
    probe = Probe(net, ProbeConfig(every=1, act_sample=1000), total_steps=1)
    with probe.step(0) as p:
        out = net(torch.randn(5, 3))
        grad = awkward(out.numel(), 11).reshape(out.shape)
        out.backward(grad)
        p.collect()
    cols = p.columns
    zeros, small = reference_counts(grad)
    assert cols["act_grad_frac_zero"][0] == pytest.approx(zeros / grad.numel())
    assert cols["act_grad_frac_fp16_underflow"][0] == pytest.approx((small - zeros) / (grad.numel() - zeros))
