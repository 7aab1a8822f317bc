"""Data choices: the shipped digits, the synthetic views, and CIFAR-10 read from a local
folder in its own format (written here, tiny), never downloaded."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import compose_config

from gradrepro.data import build_data
from gradrepro.errors import UserError


def test_digits_views_share_the_image_and_differ_in_augmentation():
    cfg = compose_config(["data=digits", "data.views=true"])
    data = build_data(cfg.data, seed=0)
    batch = data.sample(torch.Generator().manual_seed(0))
    assert batch.x.shape == (cfg.data.batch_size, 1, 8, 8) and batch.x2.shape == batch.x.shape
    assert not torch.equal(batch.x, batch.x2)
    assert abs(float(data.x_train.mean())) < 1e-5  # standardised


def test_patterns_views_share_the_pattern_not_the_background():
    cfg = compose_config(["data=patterns", "data.views=true", "data.batch_size=64"])
    data = build_data(cfg.data, seed=0)
    batch = data.sample(torch.Generator().manual_seed(0))
    assert batch.x.shape == (64, 1, 12, 12)
    # The nuisance (the background, std data.background_std) dominates each image; the views are not copies.
    assert float((batch.x - batch.x2).std()) > 1.0
    # Same class template for both views: the template's sign pattern is recoverable from
    # the view difference only where it did not move; check labels instead.
    assert torch.equal(data.sample(torch.Generator().manual_seed(1)).y, data.sample(torch.Generator().manual_seed(1)).y)
    # The held-out set is fixed across runs (its own data_seed).
    again = build_data(cfg.data, seed=5)
    assert torch.equal(data.x_test, again.x_test)


def test_patterns_view_miss_leaves_that_share_of_training_views_without_the_template():
    quiet = ["data=patterns", "data.views=true", "data.batch_size=512", "data.background_std=0",
             "data.pixel_noise=0"]
    half = build_data(compose_config([*quiet, "data.view_miss=0.5"]).data, seed=0)
    batch = half.sample(torch.Generator().manual_seed(0))
    views = torch.cat([batch.x, batch.x2]).flatten(1)
    blank = (views.abs().amax(1) == 0).float()  # no background, no noise: only the template draws
    # 1,024 views at p = 0.5: the share within 4 binomial standard errors (0.0625) of a half
    assert abs(float(blank.mean()) - 0.5) < 4 * (0.25 / len(blank)) ** 0.5
    # a view that shows it shows the whole template at full amplitude
    assert torch.all(views[blank == 0].abs().amax(1) == half.cfg.amplitude)
    # 0: every view shows it; the evaluation sets never depend on the knob
    every = build_data(compose_config([*quiet, "data.view_miss=0"]).data, seed=0)
    shown = every.sample(torch.Generator().manual_seed(0))
    assert bool((torch.cat([shown.x, shown.x2]).flatten(1).abs().amax(1) > 0).all())
    assert torch.equal(every.x_test, half.x_test) and torch.equal(every.x_train, half.x_train)
    with pytest.raises(ValueError, match="view_miss"):
        build_data(compose_config(["data=patterns", "data.view_miss=1.0"]).data, seed=0)


def write_fake_cifar10(root, n_train=20, n_test=10):
    """A folder in CIFAR-10's python format (cifar-10-batches-py), with random images."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n):
        return {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                "labels": rng.integers(0, 10, n).tolist()}

    per_file = -(-n_train // 5)
    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(per_file), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(n_test), f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f)


def test_cifar10_reads_a_local_folder_without_downloading(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar

    write_fake_cifar10(tmp_path)
    # torchvision verifies archive checksums; our tiny files are not the real archive.
    monkeypatch.setattr(cifar.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(cifar, "check_integrity", lambda path, md5=None: True)
    cfg = compose_config(["data=cifar10", f"data.root={tmp_path}", "data.views=true", "data.batch_size=8",
                          "data.n_train=20", "data.n_test=10"])
    data = build_data(cfg.data, seed=0)
    assert data.x_train.shape == (20, 3, 32, 32) and data.x_test.shape == (10, 3, 32, 32)
    batch = data.sample(torch.Generator().manual_seed(0))
    assert batch.x.shape == (8, 3, 32, 32) and batch.x2 is not None


def test_cifar10_missing_folder_is_a_clear_error(tmp_path):
    cfg = compose_config(["data=cifar10", f"data.root={tmp_path / 'nowhere'}"])
    with pytest.raises(UserError, match="does not hold CIFAR-10"):
        build_data(cfg.data, seed=0)
