"""Synthetic views whose content is a small class pattern under a strong, changing nuisance.

Why this set exists: SimSiam's headline is that without stop-gradient the features fall to
chance accuracy (Chen & He 2021, Sec. 4.1: 0.1% on ImageNet). On digits a *random* encoder
already reaches ~0.97 k-NN accuracy, so that half of the claim cannot show there. Here the
class is a 4x4 +-1 template (amplitude 2) at a jittered position in a 12x12 image, under a
smooth random background (std 3.5) and pixel noise that are drawn anew for every view: two
views share the content and differ in the nuisance, so a random encoder is far below what
learning the invariance reaches (experiments/simsiam.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gradrepro.data.base import Batch, DataBase, ImageData


@dataclass
class PatternsConfig(DataBase):
    name: str = "patterns"
    n_train: int = 2000
    n_test: int = 1000
    batch_size: int = 256
    channels: int = 1
    image_size: int = 12
    num_classes: int = 10
    template_size: int = 4
    amplitude: float = 2.0
    # A freshly initialised backbone sits near chance and the SimSiam baseline still learns
    # (experiments/simsiam.md, "Knobs chosen by looking at an outcome": disclosed there).
    background_std: float = 3.5
    background_grid: int = 4  # the background is bilinear noise on a grid this coarse
    pixel_noise: float = 0.5
    jitter: int = 1  # each view moves the template by up to this many pixels
    # The probability that a training view is rendered without its template, as a random crop
    # of a natural image sometimes misses the object: then no encoder can make every pair of
    # views identical without collapsing (experiments/simsiam.md). 0: every view shows it, and
    # no draw is made for it. The evaluation sets always show it.
    view_miss: float = 0.0
    data_seed: int = 1234  # the templates and the held-out set; fixed across runs


class Patterns(ImageData):
    def __init__(self, cfg: PatternsConfig, seed: int) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.data_seed)
        t = cfg.template_size
        # KxTxT templates of +-1 entries
        self.templates = torch.randint(0, 2, (cfg.num_classes, t, t), generator=g).float() * 2 - 1
        span = cfg.image_size - t - 2 * cfg.jitter + 1
        if span < 1:
            raise ValueError("patterns: image_size too small for template_size and jitter")
        if not 0 <= cfg.view_miss < 1:
            raise ValueError(f"patterns: view_miss is a probability below 1 (0 <= p < 1), not {cfg.view_miss}")

        def items(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.randint(0, cfg.num_classes, (n,), generator=g)
            pos = torch.randint(0, span, (n, 2), generator=g) + cfg.jitter
            return y, pos

        y_train, self.pos_train = items(cfg.n_train)
        y_test, self.pos_test = items(cfg.n_test)
        # The evaluation sets are one fixed render each (same for every run and seed).
        x_train = self.render(y_train, self.pos_train, g)
        x_test = self.render(y_test, self.pos_test, g)
        super().__init__(x_train, y_train, x_test, y_test, cfg.batch_size, cfg.views)
        self.templates_device = self.templates

    def to(self, device: torch.device) -> "Patterns":
        super().to(device)
        self.pos_train = self.pos_train.to(device)
        self.templates_device = self.templates.to(device)
        return self

    def render(self, y: torch.Tensor, pos: torch.Tensor, g: torch.Generator, miss: float = 0.0) -> torch.Tensor:
        """Nx1xSxS images: template of class y at pos (+ jitter) on a fresh background; each
        image left without it with probability ``miss``."""
        cfg, device = self.cfg, y.device
        n, s, t = len(y), cfg.image_size, cfg.template_size
        templates = getattr(self, "templates_device", self.templates)
        jit = torch.randint(-cfg.jitter, cfg.jitter + 1, (n, 2), generator=g).to(device)
        top_left = pos + jit
        coarse = torch.randn(n, 1, cfg.background_grid, cfg.background_grid, generator=g)
        background = F.interpolate(coarse.to(device), size=(s, s), mode="bilinear",
                                   align_corners=True)
        background = background * (cfg.background_std / background.std().clamp_min(1e-6))
        noise = torch.randn(n, 1, s, s, generator=g).to(device) * cfg.pixel_noise
        images = background + noise
        ar = torch.arange(t, device=device)
        rows = (top_left[:, 0:1] + ar)[:, :, None]  # NxTx1
        cols = (top_left[:, 1:2] + ar)[:, None, :]  # Nx1xT
        batch = torch.arange(n, device=device)[:, None, None]
        amplitude = torch.full((n, 1, 1), cfg.amplitude, device=device)
        if miss > 0:
            amplitude *= (torch.rand(n, 1, 1, generator=g) >= miss).to(device)
        images[batch, 0, rows, cols] += amplitude * templates[y]
        return images

    def sample(self, generator: torch.Generator) -> Batch:
        idx = torch.randint(len(self.y_train), (self.batch_size,), generator=generator)
        idx = idx.to(self.y_train.device)
        y, pos = self.y_train[idx], self.pos_train[idx]
        miss = self.cfg.view_miss
        x = self.render(y, pos, generator, miss)
        if self.views:
            return Batch(x, y, self.render(y, pos, generator, miss))
        return Batch(x, y)
