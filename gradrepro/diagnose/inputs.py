"""What ``diagnose`` and ``check_derivative`` accept: a model, an optimizer, a closure that
returns the scalar loss. Anything else is one ``DiagnoseError`` line that says what to pass."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy

from gradrepro.errors import UserError


class DiagnoseError(UserError):
    """Bad input to ``diagnose`` or ``check_derivative``: one clear line."""


class DiagnoseTypeError(DiagnoseError, TypeError):
    pass


class DiagnoseValueError(DiagnoseError, ValueError):
    pass


def check_closure(closure: Any) -> None:
    """Callable with no arguments: ``diagnose`` and ``check_derivative`` call ``closure()``."""
    if not callable(closure):
        raise DiagnoseTypeError(f"closure must be callable (closure() returns the loss), not {type(closure).__name__}")
    try:
        signature = inspect.signature(closure)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return
    required = [p.name for p in signature.parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               inspect.Parameter.KEYWORD_ONLY)]
    if required:
        raise DiagnoseTypeError(
            f"closure must take no arguments (it is called as closure()), but it requires {', '.join(required)}; "
            "bind them first, e.g. lambda: loss_fn(model(x), y)")


def check_number(name: str, value: Any, low: float = 0.0, high: float = math.inf, low_open: bool = True) -> None:
    """A finite real number (not a bool, not NaN) above ``low`` (or at it) and at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise DiagnoseTypeError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        raise DiagnoseValueError(f"{name}={value!r} must be a finite number in {interval}")


def check_count(name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise DiagnoseValueError(f"{name}={value!r} must be a whole number >= {low}")


def check_flag(name: str, value: Any) -> None:
    if not (isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1))):
        raise DiagnoseTypeError(f"{name} must be True or False, not {type(value).__name__} {value!r}")


def check_options(step: Any, tiny_factor: Any, stale_factor: Any, fp16_fraction: Any, rtol: Any,
                  probe_paths: Any) -> None:
    """``diagnose``'s keyword arguments: numbers in their ranges, flags as booleans."""
    check_flag("step", step)
    check_flag("probe_paths", probe_paths)
    check_number("tiny_factor", tiny_factor, low=1.0, low_open=False)
    check_number("stale_factor", stale_factor, low=0.0)
    check_number("fp16_fraction", fp16_fraction, low=0.0, high=1.0)
    check_number("rtol", rtol, low=0.0)


def check_model_device(model: nn.Module) -> None:
    """Parameters must hold values: a model on the meta device (built without storage) has none."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise DiagnoseValueError(
            f"{type(model).__name__} has parameters on the meta device ({', '.join(meta[:3])}"
            f"{', ...' if len(meta) > 3 else ''}): they hold no values; materialize the model first "
            "(model.to_empty(device=...) and initialize it, or load its weights)")


def check_inputs(model: Any, optimizer: Any, closure: Any) -> None:
    if not isinstance(model, nn.Module):
        raise DiagnoseTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DiagnoseTypeError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
            + (" (pass the optimizer, not its param_groups or a scheduler)" if optimizer is not None else ""))
    check_closure(closure)
    if not any(True for _ in model.parameters()):
        raise DiagnoseValueError(
            f"{type(model).__name__} has no registered parameters: nothing to diagnose "
            "(if its layers live in a plain list or tensor attribute, that is the bug: "
            "use nn.ModuleList / nn.Parameter)")
    check_model_device(model)


def check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer, model_tensors: set) -> None:
    """An optimizer none of whose tensors the model holds (``model_tensors``: ids of every tensor
    ``parameter_rows`` found on the model, registered or not) was built over another model, or
    before the whole model was rebuilt: every row would be a finding of that one cause, so it is
    one refusal instead. One tensor in common is a partial mismatch, which the findings name."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and not any(id(p) in model_tensors for p in held):
        raise DiagnoseValueError(
            f"the optimizer holds {len(held)} tensor(s) and none is a parameter of this {type(model).__name__} "
            "(compared by identity): it was built over another model, or before the model was rebuilt; "
            "build it from model.parameters()")


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


def _uninitialised(model: nn.Module) -> list[str]:
    names = [f"{n or '<model>'} ({type(m).__name__})" for n, m in model.named_modules()
             if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]
    if not names and any(is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
        names = ["<model>"]
    return names


def materialize_lazy(model: nn.Module, closure: Callable[[], Any]) -> list[str]:
    """Lazy modules (``nn.LazyLinear``, ...) have no parameters until their first forward pass:
    one dry run of the closure, in eval mode, without gradients and with the random state put
    back, gives them their shapes, as PyTorch's lazy-module docs ask before training. The
    optimizer keeps them: a lazy parameter becomes a Parameter in place. Returns the modules
    that were initialised (none: nothing ran)."""
    lazy = _uninitialised(model)
    if not lazy:
        return []
    modes = [(m, m.training) for m in model.modules()]
    where = ", ".join(lazy)
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng():
            closure()
    except Exception as exc:  # noqa: BLE001 - any failure of the user's closure becomes one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DiagnoseValueError(
            f"lazy module(s) {where} are not initialised and a dry run of the closure failed ({first}); "
            "run one forward pass, model(example_batch), before calling diagnose") from None
    finally:
        for m, training in modes:
            m.training = training
    left = _uninitialised(model)
    if left:
        raise DiagnoseValueError(
            f"lazy module(s) {', '.join(left)} are still not initialised after one run of the closure (it does not "
            "call them); run one forward pass through them, model(example_batch), before calling diagnose")
    return lazy
