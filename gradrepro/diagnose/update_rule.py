"""The change one optimizer step should make, predicted from the gradient and the optimizer's
state before the step: the independent expectation ``diagnose`` compares each actual change with.

Written from the update rules as PyTorch documents them (``torch.optim.SGD`` and
``torch.optim.Adam``/``AdamW`` pages), in float64, not by calling the optimizer: a prediction
that reused the optimizer's own code could not disagree with it.

- SGD: g <- -g if maximize; g <- g + wd p; b <- g (first step) or mu b + (1 - dampening) g;
  g <- g + mu b (nesterov) or b; p <- p - lr g.
- Adam/AdamW: g <- -g if maximize; t <- t + 1; p <- p (1 - lr wd) (decoupled: AdamW) or
  g <- g + wd p (Adam); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
  v_hat <- max(v_max, v) with amsgrad; p <- p - lr / (1 - b1^t) m / (sqrt(v_hat) / sqrt(1 - b2^t) + eps).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = "SGD, Adam, AdamW"


def _f64(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    return value.detach().to(torch.float64) if torch.is_tensor(value) else value


def _scalar(value: Any) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def snapshot_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """A float64 copy of the optimizer's per-parameter state before the step."""
    return {k: (_f64(v).clone() if torch.is_tensor(v) else v) for k, v in optimizer.state.get(param, {}).items()}


def rule_name(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    return None


def predict(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
) -> torch.Tensor | None:
    """The parameter after one step (float64), or None for an optimizer whose rule we do not know."""
    rule = rule_name(optimizer)
    if rule is None or grad.is_sparse:
        return None
    p = param.detach().to(torch.float64)
    g = grad.detach().to(torch.float64)
    lr = _scalar(group["lr"])
    wd = _scalar(group.get("weight_decay", 0.0))
    if group.get("maximize", False):
        g = -g
    if rule == "sgd":
        if wd != 0:
            g = g + wd * p
        momentum = _scalar(group.get("momentum", 0.0))
        if momentum != 0:
            buf = state.get("momentum_buffer")
            buf = g.clone() if buf is None else momentum * buf + (1 - _scalar(group.get("dampening", 0.0))) * g
            g = g + momentum * buf if group.get("nesterov", False) else buf
        return p - lr * g
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    eps = _scalar(group["eps"])
    step = _scalar(state.get("step", 0.0)) + 1
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    if wd != 0:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    m = state.get("exp_avg")
    v = state.get("exp_avg_sq")
    m = (1 - beta1) * g if m is None else beta1 * m + (1 - beta1) * g
    v = (1 - beta2) * g * g if v is None else beta2 * v + (1 - beta2) * g * g
    if group.get("amsgrad", False):
        v_max = state.get("max_exp_avg_sq")
        v = v if v_max is None else torch.maximum(v_max, v)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    return p - (lr / bias1) * m / (v.sqrt() / math.sqrt(bias2) + eps)
