"""The probe's block reductions against the plain torch ops they replace: the zero and
fp16-flush counts (``count_nonzero``, ``abs() <= FP16_FLUSH``), means, spreads and norms
(float64 ``var_mean`` and ``norm``), including NaN, inf, exact-threshold and subnormal
entries, a large mean over a tiny spread, and entries of 1e-30 (whose float32 squares underflow:
they must not read as zero)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradrepro.probe import FP16_FLUSH, Probe
from gradrepro.probe import blocks as blocks_mod
from gradrepro.probe.blocks import (
    LEVEL_ROWS,
    MOMENT_ROWS,
    Layout,
    level_sums_,
    moments_,
    segment_counts,
    segment_moments,
)
from gradrepro.probe.config import ProbeConfig
from gradrepro.probe.kernels import list_norms, robust_norms


def reference_counts(x: torch.Tensor):
    return x.numel() - int(torch.count_nonzero(x)), int((x.abs() <= FP16_FLUSH).sum())


def awkward(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-12, 2, (n,), generator=g)
    x[torch.rand(n, generator=g) < 0.2] = 0.0
    special = torch.tensor([FP16_FLUSH, -FP16_FLUSH, FP16_FLUSH * 1.0000001, 2.0**-24,
                            1e-45, -0.0, float("nan"), float("inf"), -float("inf"), 3e38])
    x[: len(special)] = special[:n]
    return x


def reduce(tensors, levels=True, nan=True):
    """The probe's device passes on ``tensors`` (one layout), then its host sums: per tensor
    (zeros, flush-or-zero), (mean, ssd, sum of squares); the inputs stay untouched."""
    layout = Layout([t.numel() for t in tensors], "cpu")
    buf = layout.buffer([t.shape for t in tensors])
    stats = layout.stats(MOMENT_ROWS + LEVEL_ROWS)
    for view, t in zip(buf.views, tensors):
        view.copy_(t)
    if levels:
        level_sums_(buf.flat.abs_().view_as(buf.grid), stats, "", nan=nan)
        for view, t in zip(buf.views, tensors):
            view.copy_(t)
    moments_(buf, layout, stats, "")
    rows = {name: stats.row[name].double().numpy() for name in stats.names}
    return segment_counts(layout, rows, ""), segment_moments(layout, rows, "")


@pytest.mark.parametrize("seed", range(4))
def test_level_sums_give_the_exact_zero_and_flush_counts(seed):
    xs = [awkward(5000, seed), awkward(3, seed + 10), awkward(2048, seed + 20)]
    (zeros, small), _ = reduce(xs)
    for i, x in enumerate(xs):
        assert (zeros[i], small[i]) == reference_counts(x)


def test_counts_are_exact_across_many_blocks_and_pads(monkeypatch):
    monkeypatch.setattr(blocks_mod, "BLOCK", 64)  # many blocks, partial last blocks, pads
    sizes = [700, 900, 1, 4000, 50, 2400, 64, 0]
    xs = [awkward(n, i).nan_to_num_(0.0, 1.0, -1.0) if n > 9 else torch.randn(n) for i, n in enumerate(sizes)]
    before = [x.clone() for x in xs]
    (zeros, small), (mean, ssd, sumsq) = reduce(xs, nan=False)
    for i, x in enumerate(xs):
        assert (zeros[i], small[i]) == reference_counts(x)
        x64 = x.double()
        if x.numel():
            assert mean[i] == pytest.approx(x64.mean().item(), rel=1e-6, abs=1e-30)
            assert sumsq[i] == pytest.approx(x64.square().sum().item(), rel=1e-6)
            assert ssd[i] == pytest.approx(((x64 - x64.mean()) ** 2).sum().item(), rel=1e-5)
        assert torch.equal(x, before[i])  # the inputs themselves are not touched
    assert sumsq[-1] == 0.0 and math.isnan(mean[-1])  # an empty tensor


def test_nonfinite_entries_make_the_sums_nonfinite_for_the_recount():
    xs = [awkward(3000, 5), torch.randn(100)]
    (zeros, _), (mean, _, sumsq) = reduce(xs, nan=False)
    assert not np.isfinite(sumsq[0]) and not np.isfinite(zeros[0])  # the host recounts these
    assert np.isfinite(sumsq[1]) and zeros[1] == 0


def test_spread_is_two_pass_exact_for_a_large_mean_and_where_squares_underflow():
    g = torch.Generator().manual_seed(0)
    centred = torch.randn(100_000, generator=g) * 1e-3 + 0.9e-3
    shifted = torch.randn(100_000, generator=g) * 1e-6 + 1.0  # a large mean, a tiny spread
    collapsed = 1000.0 + 1e-3 * torch.randn(64, 256, generator=g)  # a collapsed layer
    relu = torch.relu(torch.randn(64, 32, 8, 8, generator=g)) * 3.0
    vanishing = torch.randn(1000, generator=g) * 1e-22  # squares below float32's normal range
    tiny = torch.randn(5000, generator=g) * 1e-30 + 3e-30
    xs = [centred, shifted, collapsed, relu, vanishing, tiny, torch.zeros(64), torch.tensor([3.0])]
    _, (mean, ssd, sumsq) = reduce(xs, levels=False)
    for i, x in enumerate(xs):
        x64 = x.double()
        assert mean[i] == pytest.approx(x64.mean().item(), rel=1e-6)
        assert ssd[i] == pytest.approx(((x64 - x64.mean()) ** 2).sum().item(), rel=1e-5, abs=0.0)
        assert sumsq[i] == pytest.approx(x64.square().sum().item(), rel=1e-6, abs=0.0)
    # The one-pass formula would be far off for the collapsed layer: the case is not vacuous.
    n, m = collapsed.numel(), collapsed.double().mean().item()
    one_pass = torch.dot(collapsed.reshape(-1), collapsed.reshape(-1)).item() - n * m * m
    assert abs(one_pass / ssd[2] - 1) > 0.5
    # And plain float32 squares of the tiny tensors read zero: the 2^100 copy is what saves them.
    assert torch.linalg.vector_norm(tiny).item() == 0.0


def test_list_norms_survive_tiny_entries_and_mixed_magnitudes():
    g = torch.Generator().manual_seed(1)
    mixed = torch.randn(4096, generator=g) * 1e-30
    mixed[:10] = 1.0
    xs = [torch.randn(300, generator=g) * 1e-30, torch.zeros(10), mixed,
          torch.randn(50, generator=g), torch.full((7,), 1e-44)]  # float32 subnormals
    got = robust_norms(list_norms(xs).double().numpy(), np.array([float(x.numel()) for x in xs]))
    for value, x in zip(got, xs):
        assert value == pytest.approx(x.double().norm().item(), rel=1e-5, abs=0.0)


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


def test_cpu_squares_scale_only_the_blocks_the_host_reads_scaled_and_give_the_same_values():
    """On the CPU ``squares`` scales only the blocks whose sum of squares the host takes from
    the scaled norm (found on the host, no wait there): the sums of squares must be the same
    bit for bit as those of the scaled pass over every block (the GPU's), on blocks of zeros,
    of underflowing and overflowing squares, of NaN and inf, and of ordinary values; ``work``
    is left as it was."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(64, generator=g) * s for s in (1.0, 1e-3, 1e-19, 1e-30, 1e-40, 1e19, 1e30)]
    rows += [torch.zeros(64), torch.full((64,), float("nan")), torch.full((64,), float("inf")),
             torch.cat([torch.zeros(63), torch.tensor([1e-44])])]
    grid = torch.stack(rows)
    grid[0, :10] = 0.0  # a partly zero block stays an ordinary one
    layout = Layout([grid.numel()], "cpu", block=64)
    stats = layout.stats(("x_hi", "x_lo"))
    work = grid.clone()
    assert blocks_mod.squares(grid, stats, "x_", work=work) is False
    assert torch.equal(work.nan_to_num(), grid.nan_to_num())  # untouched
    scaled = torch.mul(grid, blocks_mod.lo_scale(stats.column["x_hi"], *stats.scales))
    full_lo = torch.linalg.vector_norm(scaled, dim=1).numpy().astype(np.float64)
    hi = stats.row["x_hi"].numpy().astype(np.float64)
    lo = stats.row["x_lo"].numpy().astype(np.float64)
    real = np.full(len(rows), 64.0)
    ours = blocks_mod.squares_from_norms(hi, lo, real)
    theirs = blocks_mod.squares_from_norms(hi, full_lo, real)
    assert np.array_equal(ours, theirs, equal_nan=True)
    need = blocks_mod.lo_needed(stats.row["x_hi"].numpy(), 64)
    assert set(need.tolist()) >= {3, 4, 5, 6, 7, 8, 9, 10}  # tiny, huge, zero, NaN, inf, subnormal
    assert 0 not in need and 1 not in need
    assert np.array_equal(lo[need], full_lo[need], equal_nan=True)
