"""``logger=tensorboard``: scalars, per-module gradient norms and magnitude histograms land in
an event folder inside the run folder; non-finite values are counted, not lost."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip(
    "tensorboard", reason="logger=tensorboard is an optional extra: pip install -e '.[tensorboard]'"
)


def events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tensorboard_run_writes_scalars_grad_norms_and_histograms(cli):
    result = cli("experiment=simsiam_baseline", "scale=tiny", "threads=1", "logger=tensorboard")
    assert result.returncode == 0, result.stderr[-2000:]
    acc = events(result.run_dir / "tensorboard")
    tags = acc.Tags()
    modules = list(dict.fromkeys(result.modules["module"]))
    assert {"loss", "z_std", "knn_acc"} <= set(tags["scalars"])
    assert {f"grad_norm/{m}" for m in modules} <= set(tags["scalars"])
    assert {f"grad_abs/{m}" for m in modules} | {"grad_norm_per_tensor"} <= set(tags["histograms"])
    logged = result.scalars.dropna(subset=["loss"])
    assert [e.step for e in acc.Scalars("loss")] == logged["step"].tolist()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(
        logged["loss"].tolist(), rel=1e-6
    )
    assert not [t for t in tags["scalars"] if t.startswith("nonfinite/")]


def test_nonfinite_values_are_counted_not_crashing_or_vanishing(tmp_path):
    from gradrepro.records.tensorboard import TensorBoardRecords

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    net[0].weight.grad[0, :2] = float("inf")
    net[0].weight.grad[1, 0] = float("nan")
    records = TensorBoardRecords(tmp_path, net, tmp_path / "tb")
    for step in (0, 1):
        records.add_scalars({"step": step, "loss": math.nan if step else 1.0, "z_std": 0.5})
        records.add_modules(
            {
                "step": np.array([step] * 4),
                "module": np.array(["0", "0", "1", "1"], dtype=object),
                "grad_norm": np.array([math.inf, 2.0, 1.0, np.nan]),  # NaN: a tensor with no grad
            }
        )
    records.flush()
    records.close()
    acc = events(tmp_path / "tb")
    scalar = lambda tag: [(e.step, e.value) for e in acc.Scalars(tag)]  # noqa: E731
    assert scalar("loss") == [(0, 1.0)]
    assert scalar("nonfinite/loss") == [(1, 1.0)]
    assert scalar("nonfinite/grad_norm/0") == [(0, 1.0), (1, 2.0)]  # running count
    assert scalar("grad_norm/1") == [(0, 1.0), (1, 1.0)]
    assert scalar("nonfinite/grad_elements/0") == [(0, 3.0), (1, 6.0)]
    histo = acc.Histograms("grad_abs/0")[0].histogram_value
    assert histo.num == net[0].weight.numel() + net[0].bias.numel() - 3  # the finite ones
    assert (tmp_path / "scalars.parquet").exists()  # the records themselves are untouched


def test_unknown_logger_is_one_line_error(cli):
    result = cli("experiment=simsiam_baseline", "scale=tiny", "logger.name=wandb")
    assert result.returncode == 2
    assert "logger.name='wandb' is not valid" in result.stderr
