"""Weight initialisation schemes for conv and linear layers (``init.scheme``).

Checked against the papers:
- He et al. 2015, Eq. 10 (forward, n = k^2 c = fan_in) and Eq. 14 (backward, n = k^2 d =
  fan_out): (1/2) n Var[w] = 1, a zero-mean Gaussian of std sqrt(2/n). ``init.mode`` picks n.
- "Xavier" as He et al. compare it (Sec. 2.2): n Var[w] = 1, a Gaussian of std sqrt(1/n)
  (Caffe's xavier filler has the same variance with a uniform law); same ``init.mode``.
- Glorot & Bengio 2010, Eq. 1 ("standard"): U[-1/sqrt(n), 1/sqrt(n)], n = fan_in, so
  n Var[W] = 1/3; Eq. 16 ("normalized"): U[-sqrt(6)/sqrt(n_in + n_out), +].
"""

from __future__ import annotations

import math
from typing import Dict

import torch
from torch import nn

INIT_SCHEMES = ("default", "kaiming", "xavier", "normal", "glorot_standard", "glorot_normalized")
INIT_MODES = ("fan_in", "fan_out")


def fans(weight: torch.Tensor) -> tuple[int, int]:
    """(fan_in, fan_out): n = k^2 c and k^2 d in He et al.'s notation."""
    receptive = weight[0][0].numel() if weight.dim() > 2 else 1
    return weight.shape[1] * receptive, weight.shape[0] * receptive


def scheme_std(scheme: str, fan_in: int, fan_out: int, std: float = 0.01, mode: str = "fan_in") -> float:
    """The standard deviation each scheme gives one weight tensor."""
    n = fan_in if mode == "fan_in" else fan_out
    if scheme == "kaiming":  # He et al. 2015, Eq. 10 / Eq. 14: (1/2) n Var[w] = 1
        return math.sqrt(2.0 / n)
    if scheme == "xavier":  # He et al.'s "Xavier": n Var[w] = 1
        return math.sqrt(1.0 / n)
    if scheme == "normal":
        return std
    if scheme == "glorot_standard":  # U[-a, a] has variance a^2 / 3
        return 1.0 / math.sqrt(fan_in) / math.sqrt(3.0)
    if scheme == "glorot_normalized":
        return math.sqrt(6.0 / (fan_in + fan_out)) / math.sqrt(3.0)
    raise ValueError(f"unknown init.scheme {scheme!r}; choose one of {', '.join(INIT_SCHEMES[1:])}")


@torch.no_grad()
def init_weight(weight: torch.Tensor, scheme: str, std: float, mode: str = "fan_in") -> None:
    fan_in, fan_out = fans(weight)
    sigma = scheme_std(scheme, fan_in, fan_out, std, mode)
    if scheme.startswith("glorot_"):  # uniform laws (Glorot & Bengio 2010, Eqs. 1 and 16)
        bound = sigma * math.sqrt(3.0)
        weight.uniform_(-bound, bound)
    else:
        weight.normal_(0.0, sigma)


def initialize(net: nn.Module, scheme: str, std: float = 0.01, mode: str = "fan_in") -> Dict[str, float]:
    """Re-initialise every conv and linear weight (biases to zero); ``default`` keeps PyTorch's.
    Returns the network's shape facts as run constants (``init_constants``): each weight's fans
    and the std the scheme gave it, so that a metric reads them instead of copies of config."""
    if scheme == "default":
        return {}
    constants: Dict[str, float] = {}
    for name, module in net.named_modules():
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            init_weight(module.weight, scheme, std, mode)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            fan_in, fan_out = fans(module.weight)
            constants.update(init_constants(f"{name}.weight" if name else "weight", fan_in, fan_out,
                                            scheme_std(scheme, fan_in, fan_out, std, mode)))
    return constants


def init_constants(param: str, fan_in: int, fan_out: int, std: float) -> Dict[str, float]:
    """``init/<module>.weight/{fan_in,fan_out,std}``: one weight's shape facts as constants."""
    return {f"init/{param}/fan_in": float(fan_in), f"init/{param}/fan_out": float(fan_out),
            f"init/{param}/std": float(std)}
