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
  A complex tensor is stepped as its real and imaginary parts (``torch.view_as_real``), as the
  Adam page says.
- SparseAdam ("a masked version of Adam": only the entries present in the sparse gradient
  update their moments and the parameter): on those entries m and v as in Adam, and
  p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps); elsewhere nothing moves.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradrepro.diagnose.graph import wide

SUPPORTED = "SGD, Adam, AdamW, SparseAdam"


def _scalar(value: Any) -> float:
    return float(value.item()) if torch.is_tensor(value) else float(value)


def snapshot_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """A copy of the optimizer's per-parameter state before the step, in its own dtype
    (``predict`` widens what it uses)."""
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in optimizer.state.get(param, {}).items()}


def rule_name(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SparseAdam):
        return "sparse_adam"
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
    if rule is None:
        return None
    p, g = wide(param), wide(grad)
    state = {k: (wide(v) if torch.is_tensor(v) and (v.is_floating_point() or v.is_complex()) else v)
             for k, v in state.items()}
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
    if rule == "sparse_adam":
        return _sparse_adam(p, grad, g, state, lr, beta1, beta2, eps, step)
    if p.is_complex():
        return torch.view_as_complex(_adam(optimizer, group, torch.view_as_real(p), torch.view_as_real(g),
                                           {k: _real_view(v) for k, v in state.items()}, lr, beta1, beta2, eps, step))
    return _adam(optimizer, group, p, g, state, lr, beta1, beta2, eps, step)


def _real_view(value: Any) -> Any:
    return torch.view_as_real(value) if torch.is_tensor(value) and value.is_complex() else value


def _adam(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
          state: dict[str, Any], lr: float, beta1: float, beta2: float, eps: float, step: float) -> torch.Tensor:
    wd = _scalar(group.get("weight_decay", 0.0))
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


def _sparse_adam(p: torch.Tensor, grad: torch.Tensor, g: torch.Tensor, state: dict[str, Any], lr: float,
                 beta1: float, beta2: float, eps: float, step: float) -> torch.Tensor:
    """SparseAdam: the entries the sparse gradient holds (summed over repeated indices) move."""
    if grad.is_sparse:
        sparse_dims = grad.sparse_dim()
        rows = torch.zeros(grad.shape[:sparse_dims], dtype=torch.bool, device=grad.device)
        rows[tuple(grad.detach().coalesce().indices())] = True
        touched = rows.reshape(rows.shape + (1,) * (grad.dim() - sparse_dims)).expand(grad.shape)
    else:
        touched = torch.ones_like(g, dtype=torch.bool)
    m = state.get("exp_avg")
    v = state.get("exp_avg_sq")
    m = torch.zeros_like(p) if m is None else m
    v = torch.zeros_like(p) if v is None else v
    m = torch.where(touched, beta1 * m + (1 - beta1) * g, m)
    v = torch.where(touched, beta2 * v + (1 - beta2) * g * g, v)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    return p - torch.where(touched, step_size * m / (v.sqrt() + eps), torch.zeros_like(p))
