"""scale=cifar, SimSiam's CIFAR-10 recipe: the learning rate follows the batch (0.03 x B/256),
the paper's augmentation gives two different views inside the image range, and a local folder
in CIFAR-10's official python format runs end to end at a tiny budget (the GPU run at the
recipe's budget is in tests/test_cuda.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import compose_config

from gradrepro.data.augment import rotate_hue, simsiam_view


def test_the_learning_rate_follows_the_batch_by_the_linear_scaling_rule():
    assert compose_config(["experiment=simsiam_baseline", "scale=cifar"]).optim.lr == pytest.approx(0.06)
    assert compose_config(["experiment=simsiam_baseline", "scale=cifar", "data.batch_size=256"]).optim.lr == 0.03


def test_the_papers_augmentation_gives_two_different_views_of_each_image():
    x = torch.rand(64, 3, 32, 32)
    generator = torch.Generator().manual_seed(0)
    a, b = simsiam_view(x, generator), simsiam_view(x, generator)
    assert a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    assert (a - b).flatten(1).abs().mean(1).min() > 0  # every image's two views differ
    # A hue rotation by a full turn is the identity, and by 0 too.
    np.testing.assert_allclose(rotate_hue(x, torch.full((64,), 2 * np.pi)), x, atol=1e-5)
    np.testing.assert_allclose(rotate_hue(x, torch.zeros(64)), x, atol=1e-5)


def write_fake_cifar10(root, per_batch: int = 8) -> None:
    """CIFAR-10's python layout: cifar-10-batches-py/data_batch_1..5 and test_batch, each a
    pickled dict with 'data' (N x 3072 uint8, channel-major rows) and 'labels'."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        entry = {"batch_label": f"batch {i}", "labels": rng.integers(0, 10, per_batch).tolist(),
                 "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "filenames": [f"img_{i}_{j}.png" for j in range(per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)


def test_scale_cifar_runs_on_a_local_cifar10_folder(cli, tmp_path):
    write_fake_cifar10(tmp_path / "cifar")
    result = cli("experiment=simsiam_nostopgrad", "scale=cifar", "data=cifar10", f"data.root={tmp_path / 'cifar'}",
                 "data.n_train=40", "data.n_test=8", "train.steps=2", "data.batch_size=8", "eval.every=2",
                 "probe.every=1", "threads=1", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, scalars = result.summary, result.scalars
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["constants"]["n_test"] == 8
    assert np.isfinite(scalars["loss"].dropna()).all() and scalars["knn_acc"].notna().sum() == 2
