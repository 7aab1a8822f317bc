"""Gradient states and what kind of module a parameter belongs to: the probe's and
``diagnose``'s shared vocabulary.

``none`` (no graph path: ``.grad`` is None), ``zero`` (exact zeros), ``tiny`` (finite,
non-zero, grad/param ratio at least ``tiny_factor`` below the model's median), ``finite``,
``nonfinite``: three different causes (no path, underflow or a dead unit, attenuation) that
are never merged into one number.
"""

from __future__ import annotations

import numpy as np
from torch import nn

# fp16's smallest subnormal is 2^-24; round-to-nearest-even sends |x| <= 2^-25 to zero
# (Micikevicius et al. 2018, Sec. 3.2; IEEE 754 binary16).
FP16_FLUSH = 2.0**-25

GRAD_STATES = ("none", "zero", "tiny", "finite", "nonfinite")


_KINDS = (
    (nn.modules.conv._ConvNd, "conv"),
    (nn.Linear, "linear"),
    (nn.modules.batchnorm._NormBase, "norm"),
    (nn.LayerNorm, "norm"),
    (nn.GroupNorm, "norm"),
    (nn.Embedding, "embedding"),
)


def module_kind(module: nn.Module) -> str:
    for cls, kind in _KINDS:
        if isinstance(module, cls):
            return kind
    return "other"


def grad_states(
    has_grad: np.ndarray,
    nonfinite: np.ndarray,
    nonzero: np.ndarray,
    grad_to_param: np.ndarray,
    param_norm: np.ndarray,
    tiny_factor: float,
) -> np.ndarray:
    """Classify each parameter's gradient. ``tiny`` is judged against the median ratio of
    the judgeable tensors (finite, non-zero grad, non-zero parameter): healthy networks
    span orders of magnitude between layers, so the maximum would raise false alarms."""
    judgeable = has_grad & (nonfinite == 0) & (nonzero > 0) & (param_norm > 0)
    judgeable &= np.isfinite(grad_to_param)
    median = np.median(grad_to_param[judgeable]) if judgeable.any() else np.nan
    tiny = judgeable & (grad_to_param < median / tiny_factor)
    state = np.full(len(has_grad), "finite", dtype=object)
    state[tiny] = "tiny"
    state[has_grad & (nonzero == 0)] = "zero"
    state[has_grad & (nonfinite > 0)] = "nonfinite"
    state[~has_grad] = "none"
    return state
