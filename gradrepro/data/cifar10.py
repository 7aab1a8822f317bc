"""CIFAR-10 from a local folder (torchvision's format), never downloaded at run time."""

from __future__ import annotations

import os
import pickle
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradrepro.data.augment import simsiam_view
from gradrepro.data.base import DataBase, ImageData, random_shift
from gradrepro.errors import UserError, first_line
from gradrepro.records.untrusted import file_kind

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
# The official format (the python version of the CIFAR-10 archive): each batch holds 10,000
# images as a uint8 array of 10000 x 3072 (3 x 32 x 32, channels first) and 10,000 labels
# in 0..9. A smaller batch is accepted (a subset); nothing larger is.
IMAGES_PER_BATCH = 10_000
PIXELS = 3 * 32 * 32
NUM_CLASSES = 10
# A batch file is its pixels plus labels and file names (31 MB); one over twice its pixel
# payload is not a CIFAR-10 batch, and is not read.
MAX_BATCH_BYTES = 2 * IMAGES_PER_BATCH * PIXELS


def check_cifar10_root(root: str) -> None:
    folder = os.path.join(root, "cifar-10-batches-py")
    missing = [f for f in _TRAIN_FILES + _TEST_FILES if not os.path.lexists(os.path.join(folder, f))]
    if missing:
        raise UserError(
            f"data.root={root!r} does not hold CIFAR-10 (expected {folder!r} with "
            f"{', '.join(_TRAIN_FILES + _TEST_FILES)}; missing: {', '.join(missing)}) from the "
            "python version of the CIFAR-10 archive; nothing is downloaded at run time: put the "
            "extracted archive there or choose data=digits or data=patterns"
        )
    for name in _TRAIN_FILES + _TEST_FILES:
        _check_batch_file(os.path.join(folder, name))


def _check_batch_file(path: str) -> None:
    """A batch file must be a regular file of a batch's size at most (checked before it is opened)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UserError(f"the CIFAR-10 batch {path!r} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"the CIFAR-10 batch {path!r} is {file_kind(info.st_mode)}, not a regular file")
    if info.st_size > MAX_BATCH_BYTES:
        raise UserError(f"the CIFAR-10 batch {path!r} has {info.st_size} bytes, more than a batch of "
                        f"{IMAGES_PER_BATCH} images can ({MAX_BATCH_BYTES}): not the official format")


def _bounded(reconstruct):
    """numpy's array constructor, refusing a shape larger than a batch before it allocates:
    a small pickle could otherwise ask for any size."""

    def bounded_reconstruct(subtype, shape, dtype):
        size = float(np.prod(np.asarray(shape, dtype=np.float64)))
        if not size <= IMAGES_PER_BATCH * PIXELS:
            raise pickle.UnpicklingError(f"refusing an array of {size:.3g} values (a batch holds "
                                         f"{IMAGES_PER_BATCH * PIXELS})")
        return reconstruct(subtype, shape, dtype)

    return bounded_reconstruct


class _ArraysOnly(pickle.Unpickler):
    """CIFAR-10's python batches are pickles; a pickle can run any code it names. This one
    builds dicts, lists, strings and numpy arrays of at most a batch's size and refuses every
    other global (Python docs, pickle, "Restricting Globals")."""

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
        found = super().find_class(module, name)
        return _bounded(found) if name == "_reconstruct" else found


def _check_entry(entry: Any) -> tuple[np.ndarray, np.ndarray]:
    """(images N x 3072 uint8, labels N int64) of a batch in the official format, or ValueError."""
    if not isinstance(entry, dict) or "data" not in entry:
        raise ValueError("not a CIFAR-10 batch (no 'data' entry)")
    data = entry["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        shape = getattr(data, "shape", None)
        raise ValueError(f"'data' must be a uint8 array of N x {PIXELS} (N images of 3x32x32), not "
                         f"{type(data).__name__} {getattr(data, 'dtype', '')} {shape}")
    if not 0 < len(data) <= IMAGES_PER_BATCH:
        raise ValueError(f"'data' holds {len(data)} images; a batch holds 1 to {IMAGES_PER_BATCH}")
    raw = entry.get("labels", entry.get("fine_labels"))
    if not isinstance(raw, (list, np.ndarray)) or len(raw) != len(data):
        raise ValueError(f"'labels' must be a list of one label per image ({len(data)}), not "
                         f"{type(raw).__name__} of {len(raw) if hasattr(raw, '__len__') else '?'}")
    if not all(isinstance(y, (int, np.integer)) and not isinstance(y, bool) for y in raw):
        raise ValueError("'labels' must be whole numbers")
    labels = np.asarray(raw, dtype=np.int64)
    bad = labels[(labels < 0) | (labels >= NUM_CLASSES)]
    if bad.size:
        raise ValueError(f"labels must be 0 to {NUM_CLASSES - 1}; found {int(bad[0])}")
    return data, labels


def load_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images NxHxWxC uint8, labels) of one CIFAR-10 python batch, without trusting the file:
    a regular file of a batch's size at most, holding what the official format holds."""
    _check_batch_file(path)
    try:
        with open(path, "rb") as f:
            data, labels = _check_entry(_ArraysOnly(f, encoding="latin1").load())
    except Exception as exc:  # noqa: BLE001 - a corrupt, truncated or hostile file: one line, not a traceback
        raise UserError(f"could not read the CIFAR-10 batch {path!r}: {first_line(exc)}") from None
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


class Cifar10(ImageData):
    def __init__(self, cfg: Cifar10Config, seed: int) -> None:
        root = os.path.expanduser(cfg.root)
        check_cifar10_root(root)
        folder = os.path.join(root, "cifar-10-batches-py")

        def read(files: tuple) -> tuple[np.ndarray, np.ndarray]:
            parts = [load_batch(os.path.join(folder, f)) for f in files]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

        train, test = read(_TRAIN_FILES), read(_TEST_FILES)

        def tensors(split: tuple, n: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
            if n > len(split[0]):  # fewer examples than asked for would be a silent change of scale
                raise UserError(f"{key}={n} but {folder!r} holds {len(split[0])} such images; "
                                f"set {key}={len(split[0])} or less")
            x = torch.from_numpy(np.ascontiguousarray(split[0][:n])).permute(0, 3, 1, 2).float() / 255
            y = torch.from_numpy(split[1][:n].copy())
            return (x - _MEAN) / _STD, y

        x_train, y_train = tensors(train, cfg.n_train, "data.n_train")
        x_test, y_test = tensors(test, cfg.n_test, "data.n_test")
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
