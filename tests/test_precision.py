"""fp16 emulation rounds as IEEE binary16 does, agrees with real CPU autocast, the loss
shift leaves fp32 bit-identical, and the four precision experiments give opposite verdicts
to their control (Micikevicius et al., ICLR 2018)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config, probe_step, read_tables
from torch import nn

from gradrepro.config.schema import PrecisionConfig, ProbeConfig
from gradrepro.probe import Probe
from gradrepro.probe.kernels import HIST_COLUMNS, log2_histogram
from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate
from gradrepro.signature.metrics.precision import flush_fraction
from gradrepro.train.loop import run
from gradrepro.train.precision import Precision, RoundGradToFP16, round_to_fp16

EXPERIMENTS = ["precision_fp32", "precision_fp16_noscale", "precision_fp16_scale8", "precision_fp16_dynamic"]

# (input, IEEE binary16 round-to-nearest-even result), worked out by hand from the format:
# subnormal step 2^-24, normal from 2^-14 with 10 mantissa bits, max 65504.
KNOWN = [
    (2.0**-24, 2.0**-24),  # smallest subnormal
    (2.0**-25, 0.0),  # exactly half of it: ties to even (0)
    (2.0**-25 * (1 + 2.0**-10), 2.0**-24),  # just above half: up
    (2.0**-26, 0.0),
    (3 * 2.0**-26, 2.0**-24),  # 0.75 ulp: up
    (1.5 * 2.0**-24, 2.0**-23),  # tie between 1 and 2 ulps: to even (2)
    (2.5 * 2.0**-24, 2.0**-23),  # tie between 2 and 3 ulps: to even (2)
    (2.0**-14 - 2.0**-24, 2.0**-14 - 2.0**-24),  # largest subnormal is exact
    (2.0**-14, 2.0**-14),  # smallest normal
    (2.0**-14 * (1 + 2.0**-11), 2.0**-14),  # half a normal ulp above: ties to even
    (2.0**-14 * (1 + 2.0**-10), 2.0**-14 * (1 + 2.0**-10)),  # one normal ulp: exact
    (65504.0, 65504.0),  # max
    (65519.0, 65504.0),  # below the overflow midpoint
    (65520.0, math.inf),  # the midpoint overflows
    (2.0**-40, 0.0),
]


@pytest.mark.parametrize("x, expected", KNOWN)
def test_fp16_rounding_matches_ieee_including_subnormals(x, expected):
    for sign in (1.0, -1.0):
        t = torch.tensor([sign * x], dtype=torch.float32)
        assert round_to_fp16(t).item() == sign * expected
        # The same rounding is what the emulated backward applies to activation gradients.
        leaf = torch.zeros(1, requires_grad=True)
        RoundGradToFP16.apply(leaf).backward(t)
        assert leaf.grad.item() == sign * expected


def test_fp16_rounding_matches_numpy_float16_on_a_log_uniform_sweep():
    rng = np.random.default_rng(0)
    x = (2.0 ** rng.uniform(-30, 2, 20000) * rng.choice([-1, 1], 20000)).astype(np.float32)
    ours = round_to_fp16(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ours, x.astype(np.float16).astype(np.float32))


def test_log2_histogram_bins_zero_octaves_and_out_of_range():
    g = torch.tensor([0.0, 2.0**-41, 2.0**-40, 1.5 * 2.0**-27, 2.0**-25, 0.75, 1.0, math.inf])
    counts = dict(zip(HIST_COLUMNS, log2_histogram(g).tolist()))
    assert counts["act_grad_hist_zero"] == 1
    assert counts["act_grad_hist_below"] == 1
    assert counts["act_grad_hist_-40"] == 1
    assert counts["act_grad_hist_-27"] == 1  # SSD's band [2^-27, 2^-24)
    assert counts["act_grad_hist_-25"] == 1
    assert counts["act_grad_hist_-1"] == 1
    assert counts["act_grad_hist_above"] == 2
    assert sum(counts.values()) == len(g)
    # Pooled flush fraction: bins wholly at or below 2^-25 flush, and a scale moves the limit.
    series = pd.Series(counts)
    assert flush_fraction(series) == pytest.approx(3 / 7)  # below, -40, -27 of 7 non-zero
    assert flush_fraction(series, at_scale_ratio=8.0) == pytest.approx(2 / 7)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def layer_grads(mode: str, loss_scale, shift: float, x, y) -> list:
    net = mlp()
    prec = Precision(PrecisionConfig(mode=mode, loss_scale=loss_scale, loss_shift=shift), torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with prec.autocast():
        loss = F.cross_entropy(net(x).float(), y)
    prec.backward(loss)
    prec.unscale(opt)
    return [m.weight.grad.clone() for m in net if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("shift, scale", [(2.0**-16, 1.0), (2.0**-16, 8.0), (2.0**-12, 1.0), (1.0, 1.0)])
def test_emulation_agrees_with_real_cpu_autocast_per_layer(shift, scale):
    torch.manual_seed(1)
    x, y = torch.randn(128, 1, 8, 8), torch.randint(0, 10, (128,))
    ref = layer_grads("fp32", 1.0, 1.0, x, y)
    real = layer_grads("fp16", scale, shift, x, y)
    emu = layer_grads("fp16_emulated", scale, shift, x, y)
    cos_real, cos_emu = [], []
    for r, a, b in zip(ref, real, emu):
        cos_real.append(F.cosine_similarity(r.flatten(), a.flatten(), dim=0).item())
        cos_emu.append(F.cosine_similarity(r.flatten(), b.flatten(), dim=0).item())
    np.testing.assert_allclose(cos_emu, cos_real, atol=0.01)
    if shift == 2.0**-16 and scale == 1.0:  # the regime is real: both paths lose signal
        assert min(cos_real) < 0.9


def run_quiet(overrides, run_dir):
    cfg = compose_config(overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        run(cfg, run_dir)
    return pd.read_parquet(run_dir / "scalars.parquet"), pd.read_parquet(run_dir / "modules.parquet")


def test_loss_shift_leaves_fp32_training_bit_identical(tmp_path):
    common = ["experiment=precision_fp32", "train.steps=30", "probe.every=5"]
    s1, m1 = run_quiet([*common, "precision.loss_shift=1.0"], tmp_path / "c1")
    s2, m2 = run_quiet(common, tmp_path / "c16")  # the experiment's 2^-16
    np.testing.assert_array_equal(s1["loss"].to_numpy(), s2["loss"].to_numpy())
    np.testing.assert_array_equal(s1["test_acc"].to_numpy(), s2["test_acc"].to_numpy())
    for col in ("grad_norm", "param_norm", "update_to_param"):
        np.testing.assert_array_equal(m1[col].to_numpy(), m2[col].to_numpy())
    # ... while every backward value moved down 16 octaves (the histogram the probe sees).
    h1 = m1.drop_duplicates(["step", "module"])[HIST_COLUMNS].sum()
    h2 = m2.drop_duplicates(["step", "module"])[HIST_COLUMNS].sum()
    assert h1["act_grad_hist_zero"] == h2["act_grad_hist_zero"]
    assert h2["act_grad_hist_-30"] == h1["act_grad_hist_-14"]


def test_loss_shift_must_be_a_power_of_two(cli):
    result = cli("experiment=precision_fp32", "scale=tiny", "precision.loss_shift=0.001")
    assert result.returncode == 2
    assert "power of two" in result.stderr


def test_histogram_probe_is_off_by_default_and_columns_when_on():
    net = mlp()
    x = torch.randn(16, 1, 8, 8)
    for flag, present in ((False, False), (True, True)):
        probe = Probe(net, ProbeConfig(every=1, act_grad_hist=flag, act_sample=16), total_steps=1)
        net.zero_grad()
        cols = probe_step(probe, lambda: net(x).sum())
        assert ("act_grad_hist_zero" in cols) is present
        if present:  # each module's counts add up to the sampled gradient's size
            rows = pd.DataFrame(cols).drop_duplicates("module")
            assert (rows[HIST_COLUMNS].sum(axis=1) == 16 * np.array([32, 32, 10])).all()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_precision_experiment_runs_end_to_end_at_tiny_scale(tiny_runs, name):
    summary, scalars, modules = read_tables(tiny_runs[name])
    assert summary["status"] == "completed"
    assert "loss" in {c["metric"] for c in summary["checks"]}
    assert "act_grad_hist_-27" in modules and "act_grad_frac_fp16_underflow" in modules
    assert "loss_scale" in scalars and "skipped_steps" in scalars


def test_real_autocast_mode_runs_end_to_end_at_tiny_scale(cli):
    result = cli("experiment=precision_fp16_dynamic", "precision.mode=fp16", "scale=tiny")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.scalars["loss_scale"].dropna().iloc[0] == 65536.0


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for name in EXPERIMENTS:
        scalars, modules = run_quiet([f"experiment={name}"], root / name)
        out[name] = (compose_config([f"experiment={name}"]), RunRecords(scalars, modules))
    return out


def with_references(records: RunRecords, runs) -> RunRecords:
    """The records as a run of the experiment would hold them: with its reference runs."""
    refs = {"fp32": runs["precision_fp32"][1], "noscale": runs["precision_fp16_noscale"][1]}
    return RunRecords(records.scalars, records.modules, records.constants, refs)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS[1:])
def test_fp16_signature_reproduces_and_control_gets_the_opposite_verdict(default_runs, name):
    cfg, records = default_runs[name]
    _, control = default_runs["precision_fp32"]
    # The thresholds against fp32 (and the unscaled run) are checks relative_to
    # the reference runs; the control, judged by the same signature, must fail it.
    verdict = evaluate(cfg.signature, with_references(records, default_runs))
    assert verdict.reproduced, verdict.checks
    assert not evaluate(cfg.signature, with_references(control, default_runs)).reproduced


@pytest.mark.slow
def test_control_signature_reproduces_and_fails_on_the_unscaled_run(default_runs):
    cfg, control = default_runs["precision_fp32"]
    assert evaluate(cfg.signature, control).reproduced
    assert not evaluate(cfg.signature, default_runs["precision_fp16_noscale"][1]).reproduced


def test_reference_runs_are_made_by_the_run_and_recorded(cli):
    result = cli("experiment=precision_fp16_scale8", "scale=tiny", "seed=3")
    assert result.returncode == 0, result.stderr[-2000:]
    refs = result.summary["references"]
    assert set(refs) == {"fp32", "noscale"}
    assert refs["fp32"]["experiment"] == "precision_fp32"
    assert "seed=3" in refs["fp32"]["overrides"] and "scale=tiny" in refs["fp32"]["overrides"]
    ref_summary = json.loads((result.run_dir / "references" / "fp32" / "summary.json").read_text())
    assert ref_summary["experiment"] == "precision_fp32" and ref_summary["seed"] == 3
    # The relative checks were evaluated against those runs (a number, not "not recorded").
    relative = [c for c in result.summary["checks"] if c["metric"] == "loss"]
    assert relative and relative[0]["observed"] is not None
