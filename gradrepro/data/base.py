"""What every data choice provides to the runner: batches for training, fixed sets for evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch


@dataclass
class DataBase:
    """Fields shared by every data choice (``scale=tiny`` shrinks these)."""

    n_train: int = 1000
    n_test: int = 500
    batch_size: int = 128
    # Two augmented views per example (self-supervised objectives) instead of one.
    views: bool = False
    # Set by each choice: the shape models are built from (interpolated as ${data.channels}).
    channels: int = 1
    image_size: int = 8
    num_classes: int = 10


class Batch(NamedTuple):
    x: torch.Tensor  # NxCxHxW
    y: torch.Tensor  # N
    x2: Optional[torch.Tensor] = None  # NxCxHxW, the second view when views=True


def split_batch(batch: Batch, parts: int) -> list:
    """``batch`` as ``parts`` consecutive micro-batches of equal size (gradient accumulation;
    the batch size is a multiple of ``parts``, checked with the config). One part: the batch."""
    if parts == 1:
        return [batch]
    pieces = [t.chunk(parts) if t is not None else [None] * parts for t in batch]
    return [Batch(*fields) for fields in zip(*pieces)]


class ImageData:
    """A labelled image set held as tensors, with an optional two-view augmentation.

    Subclasses provide ``_train``/``_test`` tensors and may override ``augment``.
    """

    def __init__(
        self,
        x_train: torch.Tensor,
        y_train: torch.Tensor,
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        batch_size: int,
        views: bool,
    ) -> None:
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test
        self.batch_size = min(batch_size, len(x_train))
        self.views = views

    def to(self, device: torch.device) -> "ImageData":
        for name in ("x_train", "y_train", "x_test", "y_test"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One random view of each image; identity unless the data choice defines one."""
        return x

    def sample(self, generator: torch.Generator) -> Batch:
        idx = torch.randint(len(self.x_train), (self.batch_size,), generator=generator)
        idx = idx.to(self.x_train.device)
        x, y = self.x_train[idx], self.y_train[idx]
        if self.views:
            return Batch(self.augment(x, generator), y, self.augment(x, generator))
        return Batch(x, y)

    def eval_sets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bank images, bank labels, held-out images, held-out labels), un-augmented."""
        return self.x_train, self.y_train, self.x_test, self.y_test


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels (zero padding), vectorised."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, chan, rows, cols]
