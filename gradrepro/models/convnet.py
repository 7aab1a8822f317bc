"""A small conv encoder: conv3x3-BN-ReLU blocks and a global pool.

SimSiam's encoder at CPU scale (2 conv + BN + ReLU, global max-pool; experiments/simsiam.md).
A global pool makes the features translation tolerant, which is what two views of a jittered
pattern need to agree on; ``pool=avg`` is the ResNet's global average pool (He et al. 2016),
whose gradient reaches every position, where the max-pool's reaches one per channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch
from torch import nn

POOLS = ("max", "avg")


@dataclass
class ConvNetConfig:
    name: str = "convnet"
    in_channels: int = "${data.channels}"  # type: ignore[assignment]
    widths: List[int] = field(default_factory=lambda: [32, 64])
    batchnorm: bool = True
    num_classes: int = 0  # 0: a feature extractor
    pool: str = "max"  # max | avg: the global pool over the last block's positions


class ConvNet(nn.Module):
    def __init__(self, cfg: ConvNetConfig) -> None:
        super().__init__()
        if cfg.pool not in POOLS:
            raise ValueError(f"model.pool={cfg.pool!r}: choose one of {', '.join(POOLS)}")
        self.pool = cfg.pool
        blocks: list[nn.Module] = []
        channels = int(cfg.in_channels)
        for width in cfg.widths:
            blocks.append(nn.Conv2d(channels, width, 3, padding=1, bias=not cfg.batchnorm))
            if cfg.batchnorm:
                blocks.append(nn.BatchNorm2d(width))
            blocks.append(nn.ReLU())
            channels = width
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, cfg.num_classes) if cfg.num_classes > 0 else None
        self.out_dim = cfg.num_classes if cfg.num_classes > 0 else channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)  # NxCxHxW
        h = torch.amax(h, dim=(2, 3)) if self.pool == "max" else h.mean(dim=(2, 3))  # NxC
        return self.head(h) if self.head is not None else h
