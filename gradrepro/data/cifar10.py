"""CIFAR-10 from a local folder (torchvision's format), never downloaded at run time."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch

from gradrepro.data.augment import simsiam_view
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
    view_shift: int = 4  # random-crop style translation, pixels (augment=light)
    # The two views: "simsiam", the paper's augmentation (App. D; gradrepro/data/augment.py), or
    # "light": translation, flip and brightness/contrast jitter, cheaper on a CPU.
    augment: str = "simsiam"


AUGMENTATIONS = ("simsiam", "light")
_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_FILES = ("test_batch",)


def check_cifar10_root(root: str) -> None:
    folder = os.path.join(root, "cifar-10-batches-py")
    missing = [f for f in _TRAIN_FILES + _TEST_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise UserError(
            f"data.root={root!r} does not hold CIFAR-10 (expected {folder!r} with "
            f"{', '.join(_TRAIN_FILES + _TEST_FILES)}; missing: {', '.join(missing)}) from the "
            "python version of the CIFAR-10 archive; nothing is downloaded at run time: put the "
            "extracted archive there or choose data=digits or data=patterns"
        )


class _ArraysOnly(pickle.Unpickler):
    """CIFAR-10's python batches are pickles; a pickle can run any code it names. This one
    builds dicts, lists, strings and numpy arrays and refuses every other global (Python docs,
    pickle, "Restricting Globals")."""

    ALLOWED = frozenset({
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes inside protocol-2 pickles written by Python 3
    })

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load the global {module}.{name}")
        return super().find_class(module, name)


def load_batch(path: str) -> tuple[np.ndarray, list]:
    """(images NxHxWxC uint8, labels) of one CIFAR-10 python batch, without trusting the file."""
    try:
        with open(path, "rb") as f:
            entry = _ArraysOnly(f, encoding="latin1").load()
        data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = list(entry["labels"] if "labels" in entry else entry["fine_labels"])
    except Exception as exc:  # noqa: BLE001 - a corrupt, truncated or hostile file: one line, not a traceback
        raise UserError(f"could not read the CIFAR-10 batch {path!r}: {exc}") from None
    return data.transpose(0, 2, 3, 1), labels


class Cifar10(ImageData):
    def __init__(self, cfg: Cifar10Config, seed: int) -> None:
        root = os.path.expanduser(cfg.root)
        check_cifar10_root(root)
        folder = os.path.join(root, "cifar-10-batches-py")

        def read(files: tuple) -> tuple[np.ndarray, list]:
            parts = [load_batch(os.path.join(folder, f)) for f in files]
            return np.concatenate([p[0] for p in parts]), [y for p in parts for y in p[1]]

        train, test = read(_TRAIN_FILES), read(_TEST_FILES)

        def tensors(split: tuple, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.from_numpy(np.ascontiguousarray(split[0][:n])).permute(0, 3, 1, 2).float() / 255
            y = torch.tensor(split[1][:n], dtype=torch.long)
            return (x - _MEAN) / _STD, y

        x_train, y_train = tensors(train, cfg.n_train)
        x_test, y_test = tensors(test, cfg.n_test)
        super().__init__(x_train, y_train, x_test, y_test, cfg.batch_size, cfg.views)
        self.view_shift = cfg.view_shift
        if cfg.augment not in AUGMENTATIONS:
            raise ValueError(f"data.augment={cfg.augment!r} is not valid; choose one of: {', '.join(AUGMENTATIONS)}")
        self.augment_choice = cfg.augment

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.augment_choice == "simsiam":  # on [0, 1] images, as the paper's transforms
            mean, std = _MEAN.to(x.device), _STD.to(x.device)
            return (simsiam_view(x * std + mean, generator) - mean) / std
        return self._light(x, generator)

    def _light(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
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
