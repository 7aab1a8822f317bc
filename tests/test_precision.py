"""fp16 emulation rounds as IEEE binary16 does, agrees with real CPU autocast, the loss
shift leaves fp32 bit-identical, the regime's loss gives each output (p - y) / (B A) with
SSD300's A and SSD's B, the dynamic scaler keeps PyTorch's defaults, GradScaler's knobs are
used and counted, and the precision experiments' verdicts (Micikevicius et al., ICLR 2018)."""

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

from gradrepro.config.compose import compose
from gradrepro.config.schema import PrecisionConfig
from gradrepro.measure.reference_runs import REFERENCE_MARK, shared_overrides
from gradrepro.objectives.dense_classification import (
    SSD300_DEFAULT_BOXES,
    DenseClassification,
    DenseClassificationConfig,
)
from gradrepro.probe import Probe
from gradrepro.probe.config import ProbeConfig
from gradrepro.probe.kernels import HIST_COLUMNS, log2_histogram
from gradrepro.recipe.precision import Precision, RoundGradToFP16, round_to_fp16
from gradrepro.records.run import RunRecords
from gradrepro.signature import METRICS, evaluate
from gradrepro.signature.metrics.precision import flush_fraction
from gradrepro.train.pipeline import run

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


def run_quiet(overrides, run_dir, make_references=False):
    """One run in this process: (scalars, modules, summary). Without ``make_references`` the run
    makes no reference runs (a test hands it the ones it shares)."""
    cfg = compose_config(overrides)
    marks = [] if make_references else [f"{REFERENCE_MARK}=test"]
    with contextlib.redirect_stdout(io.StringIO()):
        summary = run(cfg, run_dir, [*overrides, *marks])
    return pd.read_parquet(run_dir / "scalars.parquet"), pd.read_parquet(run_dir / "modules.parquet"), summary


def records_of(run_dir, references=None) -> RunRecords:
    from gradrepro.records import read_run

    run = read_run(run_dir)
    base = run.records()
    return RunRecords(base.scalars, base.modules, base.constants, references or {})


def test_loss_shift_leaves_fp32_training_bit_identical(tmp_path):
    # The plain classifier, whose gradients stay clear of fp32's subnormals (the dense regime's
    # saturated outputs reach fp32's subnormals, where a shift changes the rounding of a product).
    common = ["scale=tiny", "probe.every=1", "probe.act_grad_hist=true", "threads=1"]
    k = 8
    s1, m1, _ = run_quiet([*common, "precision.loss_shift=1.0"], tmp_path / "c1")
    s2, m2, _ = run_quiet([*common, f"precision.loss_shift={2.0**-k}"], tmp_path / "shifted")
    np.testing.assert_array_equal(s1["loss"].to_numpy(), s2["loss"].to_numpy())
    np.testing.assert_array_equal(s1["test_acc"].to_numpy(), s2["test_acc"].to_numpy())
    for col in ("grad_norm", "param_norm", "update_to_param"):
        np.testing.assert_array_equal(m1[col].to_numpy(), m2[col].to_numpy())
    # ... while every backward value moved down k octaves (the histogram the probe sees).
    h1 = m1.drop_duplicates(["step", "module"])[HIST_COLUMNS].sum()
    h2 = m2.drop_duplicates(["step", "module"])[HIST_COLUMNS].sum()
    assert h1["act_grad_hist_zero"] == h2["act_grad_hist_zero"]
    for j in range(-24, -8):
        assert h2[f"act_grad_hist_{j - k}"] == h1[f"act_grad_hist_{j}"]


def test_ssd300_has_8732_default_boxes_and_the_experiments_average_over_them_and_ssds_batch():
    # Liu et al. 2016, Sec. 2.2 and 3: 4 or 6 boxes at each location of six source maps.
    assert sum(n * n * k for n, k in ((38, 4), (19, 6), (10, 6), (5, 6), (3, 4), (1, 4))) == 8732
    assert SSD300_DEFAULT_BOXES == 8732
    for name in EXPERIMENTS:
        cfg = compose_config([f"experiment={name}"])
        assert (cfg.objective.name, cfg.objective.locations, cfg.data.batch_size) == (
            "dense_classification", 8732, 32)  # SSD's batch (Liu et al. 2016, Sec. 3)
        assert cfg.precision.loss_shift == 1.0  # no free multiplier: the regime is the loss's


def test_each_dense_output_gets_p_minus_y_over_batch_times_locations():
    """The regime's source: the loss is a mean over B x A outputs, so each logit's gradient is
    (softmax - one-hot) / (B A), and each location's features receive only their own share."""
    torch.manual_seed(0)
    cfg = DenseClassificationConfig(locations=50, width=4, num_classes=3)
    objective = DenseClassification(cfg)
    trunk = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.ReLU())
    trunk.out_dim = 6
    net = objective.wrap(trunk)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 1, 0])
    kept = {}
    net.head[-1].register_forward_hook(lambda m, i, o: kept.setdefault("logits", o).retain_grad())
    from gradrepro.data import Batch

    objective(net, Batch(x, y)).loss.backward()
    logits = kept["logits"]  # BxKxA
    assert logits.shape == (5, 3, 50)
    onehot = F.one_hot(y, 3).float()[:, :, None]  # BxKx1
    expected = (logits.detach().softmax(1) - onehot) / (5 * 50)
    torch.testing.assert_close(logits.grad, expected)


def test_under_fp16_autocast_every_module_of_the_dense_head_outputs_fp16():
    """As a convolution with its bias does (SSD's heads): a bias added in fp32 would promote the
    per-location features and the logits to fp32, and the fp16 gradient (where values flush)
    would then lie inside the module, out of the probe's and the shadow's sight."""
    torch.manual_seed(0)
    objective = DenseClassification(DenseClassificationConfig(locations=50, width=4, num_classes=3))
    trunk = nn.Sequential(nn.Flatten(), nn.Linear(64, 6), nn.ReLU())
    trunk.out_dim = 6
    net = objective.wrap(trunk)
    x = torch.randn(5, 1, 8, 8)
    dtypes = {}
    for name, module in net.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    fp32 = net(x)
    with torch.autocast("cpu", dtype=torch.float16):
        net(x)
    assert dtypes and set(dtypes.values()) == {torch.float16}, dtypes
    # In fp32 the cast is a no-op: the same values as the sum with the bias as it is.
    h = net.trunk(x)
    features = net.head[0]
    expected = (h @ features.weight.T)[:, :, None] + features.bias[None]
    last = net.head[-1]
    expected = torch.matmul(last.weight, torch.relu(expected)) + last.bias[None, :, None]
    assert torch.equal(fp32, expected)


def test_the_dynamic_scaler_keeps_pytorchs_defaults():
    cfg = compose_config(["experiment=precision_fp16_dynamic"])
    ours = Precision(cfg.precision, torch.device("cpu")).scaler
    default = torch.amp.GradScaler("cpu")
    assert ours is not None
    assert (ours.get_scale(), ours.get_growth_interval(), ours.get_growth_factor(), ours.get_backoff_factor()) == (
        default.get_scale(), default.get_growth_interval(), default.get_growth_factor(), default.get_backoff_factor())
    assert ours.get_growth_interval() == 2000 and ours.get_scale() == 2.0**16


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
    assert {c["role"] for c in summary["checks"]} >= {"evidence"}
    assert "act_grad_hist_-27" in modules and "act_grad_lost" in modules
    for column in ("loss_scale", "skipped_steps", "scale_growths", "scale_backoffs"):
        assert column in scalars
    assert summary["constants"]["n_test"] == 64  # scale=tiny's held-out set


def test_real_autocast_mode_runs_end_to_end_at_tiny_scale(run_in_process):
    result = run_in_process("experiment=precision_fp16_dynamic", "precision.mode=fp16", "scale=tiny")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.scalars["loss_scale"].dropna().iloc[0] == 65536.0


def test_gradscaler_knobs_reach_the_scaler_and_growths_and_backoffs_are_counted():
    prec = Precision(PrecisionConfig(mode="fp16_emulated", loss_scale="dynamic", scaler_init_scale=2.0**10,
                                     scaler_growth_interval=3), torch.device("cpu"))
    assert prec.loss_scale == 2.0**10
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))

    def step(x):
        opt.zero_grad()
        with prec.autocast():
            loss = F.cross_entropy(net(x).float(), y)
        prec.backward(loss)
        prec.unscale(opt)
        return prec.step(opt)

    assert all(step(x) for _ in range(3))  # three clean steps: one growth
    assert (prec.loss_scale, prec.growths, prec.backoffs) == (2.0**11, 1, 0)
    assert not step(x * 1e30)  # overflow: the step is skipped and the scale backs off
    assert (prec.loss_scale, prec.growths, prec.backoffs) == (2.0**10, 1, 1)


def test_a_reference_takes_the_overrides_both_experiments_share_and_not_the_knob():
    overrides = ["experiment=precision_fp16_scale8", "precision.mode=fp16", "data.n_test=200", "seed=3"]
    # noscale computes in fp16 as scale8 does: it follows the run's fp16 path; fp32 stays fp32.
    assert shared_overrides(overrides, "precision_fp16_scale8", "precision_fp16_noscale", compose) == [
        "precision.mode=fp16", "data.n_test=200"]
    assert shared_overrides(overrides, "precision_fp16_scale8", "precision_fp32", compose) == ["data.n_test=200"]
    assert shared_overrides(["precision=fp16"], "precision_fp16_scale8", "precision_fp32", compose) == []


def test_reference_runs_are_made_by_the_run_and_recorded(run_in_process):
    result = run_in_process("experiment=precision_fp16_scale8", "scale=tiny", "seed=3")
    assert result.returncode == 0, result.stderr[-2000:]
    refs = result.summary["references"]
    assert set(refs) == {"fp32"}
    assert refs["fp32"]["experiment"] == "precision_fp32"
    assert "seed=3" in refs["fp32"]["overrides"] and "scale=tiny" in refs["fp32"]["overrides"]
    ref_summary = json.loads((result.run_dir / "references" / "fp32" / "summary.json").read_text())
    assert ref_summary["experiment"] == "precision_fp32" and ref_summary["seed"] == 3
    # The relative checks were evaluated against those runs (a number, not "not recorded").
    gap = [c for c in result.summary["checks"] if c["metric"] == "accuracy_gap_se"]
    assert gap and gap[0]["observed"] is not None


# --- the verdicts, at the experiments' own scale, on both fp16 paths --------------------------

def precision_runs(root, mode: str, seed: int = 0) -> dict:
    """The four experiments at their own scale, the fp16 ones on ``mode``; each failure's
    records carry the fp32 run as its reference ``fp32`` (as the run would make it)."""
    run_quiet(["experiment=precision_fp32", f"seed={seed}"], root / "fp32")
    fp32 = records_of(root / "fp32")
    out = {"precision_fp32": fp32}
    for name in EXPERIMENTS[1:]:
        run_quiet([f"experiment={name}", f"seed={seed}", f"precision.mode={mode}"], root / name)
        out[name] = records_of(root / name, {"fp32": fp32})
    return out


def check_verdicts(runs: dict) -> None:
    """Each failure reproduces; every evidence check of its signature fails on its control's
    records (the control's own references included); the fp32 control reproduces."""
    assert evaluate(compose_config(["experiment=precision_fp32"]).signature, runs["precision_fp32"]).reproduced
    for name in EXPERIMENTS[1:]:
        cfg = compose_config([f"experiment={name}"])
        verdict = evaluate(cfg.signature, runs[name])
        assert verdict.reproduced, (name, verdict.checks)
        on_control = evaluate(cfg.signature, runs[cfg.control])
        for check in on_control.checks:
            if check.role == "evidence":
                assert not check.ok, (name, "holds on its control", check)


# At the experiments' own scale (about a minute a run): slow. The SSD-structured regime does not
# reproduce the accuracy drop (experiments/precision.md, seeds 0 and 100-101), so the full verdict
# test is a strict xfail: it turns into a failure the day the verdicts hold.
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the precision verdicts do not all hold in the SSD-structured regime "
                   "(experiments/precision.md)")
@pytest.mark.parametrize("mode", ["fp16_emulated"])
def test_precision_verdicts_hold_and_evidence_fails_on_each_control(tmp_path, mode):
    runs = precision_runs(tmp_path, mode)
    check_verdicts(runs)


@pytest.mark.slow
def test_fp16_without_scaling_flushes_a_third_of_the_values_and_the_dynamic_scaler_backs_off(tmp_path):
    """What does hold in the regime: unscaled fp16 carries >= 31% of the sampled activation
    gradients as zeros where fp32 has none lost (evidence that fails on the control), and
    GradScaler at its defaults backs off from 2^16, skipping exactly the steps it backed off."""
    runs = precision_runs(tmp_path, "fp16_emulated")
    cfg = compose_config(["experiment=precision_fp16_noscale"])
    flush = [c for c in cfg.signature.checks if c.metric == "act_grad_lost"]
    on_failure = evaluate({"checks": flush}, runs["precision_fp16_noscale"]).checks[0]
    on_control = evaluate({"checks": flush}, runs["precision_fp32"]).checks[0]
    assert on_failure.ok and not on_control.ok, (on_failure, on_control)
    scalars = runs["precision_fp16_dynamic"].scalars
    scale = scalars["loss_scale"].dropna().to_numpy()
    assert scale[0] == 2.0**16 and scale.min() < 2.0**16 and not (np.diff(scale) > 0).any()
    np.testing.assert_array_equal(scalars["skipped_steps"], scalars["scale_backoffs"])


def test_accuracy_gap_is_in_binomial_standard_errors_of_the_references_accuracy():
    def acc(value, n=400):
        return RunRecords(pd.DataFrame({"step": [0, 300], "test_acc": [0.1, value]}), pd.DataFrame(), {"n_test": n})

    fp32 = acc(0.9)
    se = math.sqrt(0.9 * 0.1 / 400)  # 0.015
    own = acc(0.87)
    own.references = {"fp32": fp32}
    assert METRICS["accuracy_gap_se"](own, 1, reference="fp32") == pytest.approx(-0.03 / se)
    assert METRICS["accuracy_gap_se"](own, 1, reference="fp32", absolute=True) == pytest.approx(0.03 / se)
    perfect = acc(1.0)
    own.references = {"fp32": perfect}  # a reference without spread: any gap is infinitely many
    assert METRICS["accuracy_gap_se"](own, 1, reference="fp32") == -math.inf
    assert math.isnan(METRICS["accuracy_gap_se"](own, 1, reference="other"))
