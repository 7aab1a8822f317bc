"""torchvision's ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool), as in
SimSiam's CIFAR-10 experiments (Chen & He 2021, App. D)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchvision.models import resnet18


@dataclass
class ResNet18CifarConfig:
    name: str = "resnet18_cifar"
    in_channels: int = "${data.channels}"  # type: ignore[assignment]
    num_classes: int = 0  # 0: a 512-d feature extractor (SimSiam's backbone)


class ResNet18Cifar(nn.Module):
    def __init__(self, cfg: ResNet18CifarConfig) -> None:
        super().__init__()
        net = resnet18(num_classes=max(cfg.num_classes, 1))
        net.conv1 = nn.Conv2d(int(cfg.in_channels), 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        if cfg.num_classes == 0:
            net.fc = nn.Identity()
        self.net = net
        self.out_dim = cfg.num_classes if cfg.num_classes > 0 else 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
