"""scikit-learn's digits: 1,797 real 8x8 images of 10 classes, shipped with scikit-learn.

The default data of the classification experiments: real, offline, and small enough that
a 2-core CPU trains on it in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits

from gradrepro.data.base import DataBase, ImageData, random_shift


@dataclass
class DigitsConfig(DataBase):
    name: str = "digits"
    n_train: int = 1297
    n_test: int = 500
    channels: int = 1
    image_size: int = 8
    num_classes: int = 10
    # Views for self-supervised objectives: random shift (pixels) and additive noise (std,
    # in units of the standardised pixel).
    view_shift: int = 1
    view_noise: float = 0.3


class Digits(ImageData):
    def __init__(self, cfg: DigitsConfig, seed: int) -> None:
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8)
        y = torch.tensor(labels, dtype=torch.long)
        # A fixed split (not the run's seed): every run sees the same held-out set.
        order = torch.tensor(np.random.default_rng(0).permutation(len(x)))
        x, y = x[order], y[order]
        n_test = min(cfg.n_test, len(x) // 4)
        n_train = min(cfg.n_train, len(x) - n_test)
        x_train, y_train = x[:n_train], y[:n_train]
        x_test, y_test = x[len(x) - n_test :], y[len(x) - n_test :]
        # Standardise with the training set's statistics only.
        mean, std = x_train.mean(), x_train.std()
        super().__init__(
            (x_train - mean) / std,
            y_train,
            (x_test - mean) / std,
            y_test,
            cfg.batch_size,
            cfg.views,
        )
        self.view_shift, self.view_noise = cfg.view_shift, cfg.view_noise

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        x = random_shift(x, self.view_shift, generator)
        noise = torch.randn(x.shape, generator=generator).to(x.device)
        return x + self.view_noise * noise
