"""He et al.'s variance derivation for plain ReLU stacks (ICCV 2015, arXiv 1502.01852, Sec. 2.2).

Forward (Eq. 10): Var[y_L] = Var[y_1] prod_l (1/2) n_l Var[w_l], n_l = k^2 c_l (inputs).
Backward (Eq. 14): Var[dx_2] = Var[dx_{L+1}] prod_{l=2..L} (1/2) n^_l Var[w_l],
n^_l = k^2 d_l (filters). Their init sets every factor to 1: std = sqrt(2/n).

Discussion after Eq. 14: for VGG model B at a fixed std of 0.01, "the std of the gradient
propagated from conv10 to conv2 is 1/(1.7 x 10^4) of our derived value". That is the
backward product over layers 2..10, whose filters are 64, 128, 128, 256, 256, 512 x 4.

What the probe measures: ``act_grad_std`` at a conv layer's output is dy_l, and
dy_l = dx_{l+1} * relu'(y_l) has half of dx_{l+1}'s variance (symmetric y_l). The ratio
act_grad_std(conv1) / act_grad_std(conv10) is therefore std(dx_2) / std(dx_11), the same
quantity: the ReLU's 1/2 appears at both ends and cancels.
"""

from __future__ import annotations

import math
from typing import List, Sequence

from gradrepro.recipe.init import scheme_std

# VGG "model B" (Simonyan & Zisserman 2015, Table 1, column B), as He et al. use it.
MODEL_B_FILTERS = (64, 64, 128, 128, 256, 256, 512, 512, 512, 512)


def layer_factor(n: int, std: float) -> float:
    """(1/2) n Var[w]: what one ReLU layer multiplies the signal's variance by (Eqs. 10, 14)."""
    return 0.5 * n * std**2


def he_std(n: int) -> float:
    """The std that makes (1/2) n Var[w] = 1: sqrt(2/n) (He et al., Eq. 10 or 14)."""
    return math.sqrt(2.0 / n)


def conv_fans(filters: Sequence[int], in_channels: int, kernel: int = 3) -> List[tuple[int, int]]:
    """(fan_in, fan_out) = (k^2 c_l, k^2 d_l) of each conv layer of a stack."""
    channels = [in_channels, *filters[:-1]]
    return [(kernel**2 * c, kernel**2 * d) for c, d in zip(channels, filters)]


def layer_stds(scheme: str, filters: Sequence[int], in_channels: int, kernel: int = 3,
               std: float = 0.01, mode: str = "fan_in") -> List[float]:
    """The weight std of each conv layer under an ``init.scheme`` (gradrepro/init.py)."""
    return [scheme_std(scheme, fi, fo, std, mode) for fi, fo in conv_fans(filters, in_channels, kernel)]


def backward_std_ratio(filters: Sequence[int], stds: Sequence[float], kernel: int = 3,
                       first: int = 2, last: int | None = None) -> float:
    """std(dx_first) / std(dx_{last+1}): the gradient's std after back-propagating through
    layers last..first (1-based, inclusive), by Eq. 14 with n^_l = k^2 d_l."""
    last = len(filters) if last is None else last
    variance = 1.0
    for layer in range(first, last + 1):
        d, s = filters[layer - 1], stds[layer - 1]
        variance *= layer_factor(kernel**2 * d, s)
    return math.sqrt(variance)


def attenuation(filters: Sequence[int], in_channels: int, scheme: str, reference: str,
                kernel: int = 3, std: float = 0.01, mode: str = "fan_in",
                first: int = 2, last: int | None = None) -> float:
    """How many times smaller the back-propagated std ratio is under ``scheme`` than under
    ``reference``: the derivation's counterpart of the measured attenuation."""
    own = backward_std_ratio(filters, layer_stds(scheme, filters, in_channels, kernel, std, mode),
                             kernel, first, last)
    ref = backward_std_ratio(filters, layer_stds(reference, filters, in_channels, kernel, std, mode),
                             kernel, first, last)
    return ref / own


def weight_grad_attenuation(stds: Sequence[float], reference_stds: Sequence[float], layer: int) -> float:
    """How many times smaller layer ``layer``'s (0-based) weight gradient is under the weight
    stds ``stds`` than under ``reference_stds`` (one per weight layer, in network order) when
    both networks share their draws (each weight the same standard-normal tensor times its
    std, biases 0, so the ReLU patterns agree): the back-propagated signal at that layer's
    output is scaled by the std ratio of every layer above it (Eq. 14, one factor per layer)
    and its input is the same. The softmax gradient the loss injects is taken as equal in both;
    it is not (uniform logits against the reference's), which a check's tolerance has to cover."""
    out = 1.0
    for own, ref in list(zip(stds, reference_stds))[int(layer) + 1:]:
        out *= ref / own
    return out
