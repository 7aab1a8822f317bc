"""CIFAR-10 from a local folder (torchvision's format), never downloaded at run time."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from gradrepro.data.base import DataBase, ImageData, random_shift
from gradrepro.errors import UserError

# Per-channel statistics of the CIFAR-10 training set, as commonly used for normalisation.
_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


@dataclass
class Cifar10Config(DataBase):
    name: str = "cifar10"
    root: str = "data/cifar10"  # the folder that holds cifar-10-batches-py/
    n_train: int = 50000
    n_test: int = 10000
    batch_size: int = 512  # SimSiam App. D
    channels: int = 3
    image_size: int = 32
    num_classes: int = 10
    view_shift: int = 4  # random-crop style translation, pixels


def check_cifar10_root(root: str) -> None:
    folder = os.path.join(root, "cifar-10-batches-py")
    if not os.path.isdir(folder):
        raise UserError(
            f"data.root={root!r} does not hold CIFAR-10 (expected the folder {folder!r} "
            "from torchvision's CIFAR10 archive); nothing is downloaded at run time: put the "
            "extracted archive there or choose data=digits or data=patterns"
        )


class Cifar10(ImageData):
    def __init__(self, cfg: Cifar10Config, seed: int) -> None:
        from torchvision.datasets import CIFAR10

        root = os.path.expanduser(cfg.root)
        check_cifar10_root(root)
        try:
            train = CIFAR10(root, train=True, download=False)
            test = CIFAR10(root, train=False, download=False)
        except Exception as exc:  # torchvision reports a corrupt or partial folder this way
            raise UserError(f"data.root={root!r}: could not read CIFAR-10 ({exc})") from exc

        def tensors(ds, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(np.asarray(ds.data[:n])).permute(0, 3, 1, 2).float() / 255
            y = torch.tensor(ds.targets[:n], dtype=torch.long)
            return (x - _MEAN) / _STD, y

        x_train, y_train = tensors(train, cfg.n_train)
        x_test, y_test = tensors(test, cfg.n_test)
        super().__init__(x_train, y_train, x_test, y_test, cfg.batch_size, cfg.views)
        self.view_shift = cfg.view_shift

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        # Translation, horizontal flip and brightness/contrast jitter: a light version of
        # SimSiam's augmentation (App. D) that runs as batched tensor operations.
        x = random_shift(x, self.view_shift, generator)
        n = len(x)
        flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        contrast = (0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=generator)).to(x.device)
        bright = (0.4 * torch.randn(n, 1, 1, 1, generator=generator)).to(x.device)
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - mean) * contrast + mean + bright
