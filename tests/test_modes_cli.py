"""Every issue-6 experiment runs end to end through the real CLI at scale=tiny."""

from __future__ import annotations

import pytest

MODE_EXPERIMENTS = [
    "bn_diagnose_in_eval_mode", "bn_diagnose_in_train_mode", "bn_none", "bn_speedup",
    "bn_frozen_eval_mode", "bn_frozen_stats", "zero_grad_baseline", "zero_grad_forgotten",
    "zero_grad_lr_lookalike",
]


@pytest.mark.parametrize("name", MODE_EXPERIMENTS)
def test_experiment_runs_at_tiny_scale(cli, name):
    result = cli(f"experiment={name}", "scale=tiny")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.summary
    assert summary["status"] == "completed"
    assert summary["experiment"] == name
    assert summary["checks"] and all(c["metric"] for c in summary["checks"])
    assert len(result.scalars) > 0 and "fresh_grad_norm" in result.modules.columns
