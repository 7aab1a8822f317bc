"""A multilayer perceptron on flattened images: the classifier of small experiments and
the digits variant of SimSiam's encoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch
from torch import nn


@dataclass
class MLPConfig:
    name: str = "mlp"
    in_dim: int = "${calc:'${data.channels} * ${data.image_size} ** 2'}"  # type: ignore[assignment]
    widths: List[int] = field(default_factory=lambda: [256, 256])
    activation: str = "relu"  # relu | tanh
    batchnorm: bool = False
    # Dropout after each hidden activation, with this drop probability (0: none; Srivastava et
    # al. 2014 use 0.5 on hidden units). nn.Dropout drops in train mode only.
    dropout: float = 0.0
    # Logits for this many classes; 0 means the MLP is a feature extractor (SimSiam).
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = int(cfg.in_dim)
        for hidden in cfg.widths:
            layers.append(nn.Linear(width, hidden))
            if cfg.batchnorm:
                layers.append(nn.BatchNorm1d(hidden))
            layers.append(ACTIVATIONS[cfg.activation]())
            if cfg.dropout > 0:
                layers.append(nn.Dropout(cfg.dropout))
            width = hidden
        if cfg.num_classes > 0:
            layers.append(nn.Linear(width, cfg.num_classes))
            width = cfg.num_classes
        self.layers = nn.Sequential(*layers)
        self.out_dim = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # NxCxHxW -> NxD
        return self.layers(x)
