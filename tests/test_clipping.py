"""Gradient clipping (recipe/clipping.py) and the experiment of clipping the scaled gradients:
the clip is clip_grad_norm_'s, a clip before unscaling leaves the optimizer c / S, and the
failure's evidence holds on it and fails on its control, read with the control's own references."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.analysis.compare import compare
from gradrepro.recipe.clipping import CLIP_ORDERS, clip_at, clip_gradients_, gradient_norm
from gradrepro.records.run import RunRecords
from gradrepro.signature import METRICS

SCALE, CLIP = 2.0**10, 0.05


def scaled_backward(scale: float = SCALE) -> nn.Module:
    """A small MLP after one backward of its loss multiplied by ``scale``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    (F.cross_entropy(net(x), y) * scale).backward()
    return net


def grad_norm(net: nn.Module) -> float:
    return float(gradient_norm([p.grad for p in net.parameters()]))


def step_gradient(order: str) -> tuple:
    """(what the clip recorded, the norm the optimizer gets) for one clip order, the loop's way:
    a clip before the unscale, the unscale, a clip after it."""
    net = scaled_backward()
    cfg = SimpleNamespace(grad_clip=CLIP, clip_order=order, clip_norm_from="full_tensor")
    clipped = clip_at(cfg, net.parameters(), "before_unscale")
    for p in net.parameters():
        p.grad /= SCALE  # what GradScaler.unscale_ does (exact: a power of two)
    clipped = clipped or clip_at(cfg, net.parameters(), "after_unscale")
    return {k: float(v) for k, v in clipped.items()}, grad_norm(net)


def test_the_clip_is_clip_grad_norm_s_and_records_what_it_did():
    ours, theirs = scaled_backward(1.0), scaled_backward(1.0)
    before = grad_norm(ours)
    assert before > CLIP  # the clip acts
    recorded = clip_gradients_(list(ours.parameters()), CLIP)
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), CLIP)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert float(recorded["clip_norm"]) == pytest.approx(before, rel=1e-6)
    assert float(recorded["clip_full_norm"]) == float(recorded["clip_norm"])  # no shards: one norm
    assert float(recorded["clip_coef"]) == pytest.approx(CLIP / (before + 1e-6), rel=1e-6)
    # A norm below the threshold is left alone (the coefficient is capped at 1).
    small = scaled_backward(1.0)
    unchanged = [p.grad.clone() for p in small.parameters()]
    assert float(clip_gradients_(list(small.parameters()), 1e6)["clip_coef"]) == 1.0
    for p, g in zip(small.parameters(), unchanged):
        assert torch.equal(p.grad, g)


def test_a_clip_before_unscaling_leaves_the_optimizer_c_over_the_scale():
    """PyTorch's AMP examples: clip after unscale_. Before it, the clip sees S x the norm and
    leaves the gradients at c, which the unscale then divides by S."""
    after, after_norm = step_gradient("after_unscale")
    before, before_norm = step_gradient("before_unscale")
    assert after_norm == pytest.approx(CLIP, rel=1e-5)
    assert before_norm == pytest.approx(CLIP / SCALE, rel=1e-5)
    assert before["clip_norm"] == pytest.approx(SCALE * after["clip_norm"], rel=1e-5)  # the clip saw S x the norm
    assert before["clip_coef"] == pytest.approx(after["clip_coef"] / SCALE, rel=1e-5)  # the factor S lost
    assert set(CLIP_ORDERS) == {"after_unscale", "before_unscale"}


def test_the_scaled_clip_bound_reads_the_product_with_the_loss_scale():
    records = RunRecords(pd.DataFrame({"step": [0, 10, 20, 30], "grad_norm": [CLIP / 4, CLIP / 8, np.inf, CLIP / 8],
                                       "loss_scale": [4.0, 8.0, 16.0, 8.0]}), pd.DataFrame())
    assert METRICS["scaled_clip_bound"](records, 3, max_norm=CLIP) == pytest.approx(1.0)  # inf: a skipped step
    assert METRICS["clipped_while_scaled"](records, 3) == 1.0  # the detector: the product is constant
    honest = RunRecords(records.scalars.assign(grad_norm=CLIP), pd.DataFrame())
    assert METRICS["scaled_clip_bound"](honest, 3, max_norm=CLIP) == 16.0
    assert METRICS["clipped_while_scaled"](honest, 3) == 0.0


def test_the_update_over_the_clip_is_the_update_norm_over_lr_c():
    modules = pd.DataFrame({"step": [0, 0, 1, 1], "update_to_param": [0.1, 0.2, 0.3, 0.4],
                            "param_norm": [3.0, 4.0, 3.0, 4.0]})  # update norms: sqrt(.09+.64), sqrt(.81+2.56)
    records = RunRecords(pd.DataFrame({"step": [0, 1]}), modules)
    expected = np.array([np.sqrt(0.73), np.sqrt(3.37)]) / (0.5 * 2.0)
    assert METRICS["update_over_clip"](records, 3, max_norm=2.0, lr=0.5, reduce="max") == pytest.approx(expected.max())
    assert METRICS["update_over_clip"](records, 3, max_norm=2.0, lr=0.5) == pytest.approx(np.median(expected))


def test_clipping_the_scaled_gradients_shows_its_evidence_and_the_control_does_not(run_in_process, tmp_path):
    """Both experiments (each with its own reference runs) at 100 steps on seed 100, which no knob
    was chosen on: every evidence check of the failure holds on it and fails on the control."""
    common = ("seed=100", "train.steps=100", "eval.every=0")
    for name in ("clip_before_unscale", "clip_after_unscale"):
        result = run_in_process(f"experiment={name}", *common)
        assert result.summary["status"] == "completed", result.summary.get("error")
    own = result.summary["references"]["control"]  # the control's own reference: a replicate
    assert own["replicate"] is True and own["seed"] != 100
    tables, _, _ = compare([tmp_path])
    evidence = tables["checks"].query("role == 'evidence'")
    assert len(evidence) == 4
    for row in evidence.itertuples():
        where = f"{row.check}: failure {row.observed_failure}, control {row.observed_control}"
        assert row.ok_failure, where
        assert row.ok_control is False, where
