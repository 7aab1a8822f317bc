"""Weight initialisation schemes for conv and linear layers (``init.scheme``)."""

from __future__ import annotations

import math

import torch
from torch import nn

INIT_SCHEMES = ("default", "kaiming", "xavier", "normal", "glorot_standard", "glorot_normalized")


def fans(weight: torch.Tensor) -> tuple[int, int]:
    """(fan_in, fan_out): n = k^2 c and k^2 d in He et al.'s notation."""
    receptive = weight[0][0].numel() if weight.dim() > 2 else 1
    return weight.shape[1] * receptive, weight.shape[0] * receptive


@torch.no_grad()
def init_weight(weight: torch.Tensor, scheme: str, std: float) -> None:
    fan_in, fan_out = fans(weight)
    if scheme == "kaiming":  # He et al. 2015, Eq. 10: (1/2) n Var[w] = 1
        weight.normal_(0.0, math.sqrt(2.0 / fan_in))
    elif scheme == "xavier":  # He et al.'s "Xavier": Var[w] = 1/n (Caffe's xavier filler)
        weight.normal_(0.0, math.sqrt(1.0 / fan_in))
    elif scheme == "normal":
        weight.normal_(0.0, std)
    elif scheme == "glorot_standard":  # Glorot & Bengio 2010, Eq. 1: n Var[W] = 1/3
        bound = 1.0 / math.sqrt(fan_in)
        weight.uniform_(-bound, bound)
    elif scheme == "glorot_normalized":  # Glorot & Bengio 2010, Eq. 16
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        weight.uniform_(-bound, bound)
    else:
        raise ValueError(f"unknown init.scheme {scheme!r}; choose one of {', '.join(INIT_SCHEMES)}")


def initialize(net: nn.Module, scheme: str, std: float = 0.01) -> None:
    """Re-initialise every conv and linear weight (biases to zero); ``default`` keeps PyTorch's."""
    if scheme == "default":
        return
    for module in net.modules():
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            init_weight(module.weight, scheme, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
