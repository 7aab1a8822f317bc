"""The run figure (signals.png) shows every logged scalar a check of the signature reads."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from conftest import compose_config

from gradrepro.records.figure import checked_scalars, plot_signals


def test_the_run_figure_shows_every_scalar_a_check_reads(tmp_path):
    checks = [dict(c) for c in compose_config(["experiment=simsiam_nopredictor", "scale=tiny"]).signature.checks]
    scalars = pd.DataFrame({"step": [0, 1, 2], "loss": [0.0, -0.5, -0.9], "z_std": [0.1, 0.05, 0.01],
                            "knn_acc": [0.3, None, 0.9]})
    shown = checked_scalars(checks, list(scalars.columns))
    assert list(shown) == ["z_std", "knn_acc"]  # the k-NN accuracy is drawn, the loss has its own panel
    assert shown["knn_acc"] == [pytest.approx(0.1 + 3 * math.sqrt(0.09 / 64))]  # tiny: 64 queries
    relative = [{"metric": "steps_to", "op": "<=", "threshold": 0.5,
                 "params": {"column": "train_acc", "relative_to": "no_bn"}}]
    assert checked_scalars(relative, ["step", "train_acc"]) == {"train_acc": []}  # read, not compared directly
    plot_signals(scalars, pd.DataFrame(), tmp_path / "signals.png", "t", "z_std", shown)
    assert (tmp_path / "signals.png").stat().st_size > 0
