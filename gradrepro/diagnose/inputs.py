"""What ``diagnose`` and ``check_derivative`` accept: a model, an optimizer, a closure that
returns the scalar loss. Anything else is one ``DiagnoseError`` line that says what to pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from gradrepro.errors import UserError


class DiagnoseError(UserError):
    """Bad input to ``diagnose`` or ``check_derivative``: one clear line."""


class DiagnoseTypeError(DiagnoseError, TypeError):
    pass


class DiagnoseValueError(DiagnoseError, ValueError):
    pass


def check_inputs(model: Any, optimizer: Any, closure: Any) -> None:
    if not isinstance(model, nn.Module):
        raise DiagnoseTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DiagnoseTypeError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
            + (" (pass the optimizer, not its param_groups or a scheduler)" if optimizer is not None else ""))
    if not callable(closure):
        raise DiagnoseTypeError(f"closure must be callable (closure() returns the loss), not {type(closure).__name__}")
    if not any(True for _ in model.parameters()):
        raise DiagnoseValueError(
            f"{type(model).__name__} has no registered parameters: nothing to diagnose "
            "(if its layers live in a plain list or tensor attribute, that is the bug: "
            "use nn.ModuleList / nn.Parameter)")


def check_loss(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        raise DiagnoseTypeError(
            f"closure returned a {type(out).__name__} of {len(out)} items; return the scalar loss alone")
    if isinstance(out, (float, int, np.generic)):
        raise DiagnoseTypeError(
            f"closure returned a Python number ({out!r}): .item() or float() cut the graph; return the loss tensor")
    if not isinstance(out, torch.Tensor):
        raise DiagnoseTypeError(f"closure must return the loss tensor, not {type(out).__name__}")
    if out.numel() != 1:
        raise DiagnoseValueError(
            f"closure returned a tensor of shape {tuple(out.shape)}; reduce it to the scalar loss (.mean() or .sum())")
    if not out.is_floating_point():
        raise DiagnoseTypeError(f"closure returned a {out.dtype} tensor; a loss must be floating point")
    return out
