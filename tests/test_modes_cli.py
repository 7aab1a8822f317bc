"""Every issue-6 experiment runs end to end through the real CLI at scale=tiny (the
session's shared multirun, conftest.tiny_runs)."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import read_tables

MODE_EXPERIMENTS = [
    "bn_diagnose_in_eval_mode", "bn_diagnose_in_train_mode", "bn_none", "bn_speedup",
    "bn_frozen_eval_mode", "bn_frozen_stats", "zero_grad_baseline", "zero_grad_forgotten",
    "zero_grad_lr_lookalike",
]


@pytest.mark.parametrize("name", MODE_EXPERIMENTS)
def test_experiment_runs_at_tiny_scale(tiny_runs, name):
    summary, scalars, modules = read_tables(tiny_runs[name])
    assert summary["status"] == "completed"
    assert summary["experiment"] == name
    assert summary["checks"] and all(c["metric"] for c in summary["checks"])
    assert isinstance(scalars, pd.DataFrame) and len(scalars) > 0
    assert "fresh_grad_norm" in modules.columns
