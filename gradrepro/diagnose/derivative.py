"""An independent derivative: autograd against central finite differences, both in float64,
for chosen entries of one parameter (``check_derivative``). It tells a severed path (finite
differences non-zero, autograd nothing) from an unused one (both zero)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from gradrepro.diagnose.inputs import (
    DiagnoseTypeError,
    DiagnoseValueError,
    check_closure,
    check_count,
    check_flag,
    check_loss,
    check_number,
)

_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_INPLACE = re.compile(r"^(__i\w+__|__setitem__|\w*[^_]_)$")


class _Float64(TorchFunctionMode):
    """Runs every torch operation in float64: floating tensor arguments below float64 are
    promoted (differentiably, so gradients still reach float32 parameters). The tensor an
    in-place operation writes to is left alone, so in-place writes keep their meaning."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # attribute reads (.shape, .grad, ...) on the original tensor
            return func(*args, **kwargs)

        def up(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype in _NARROW:
                return x.to(torch.float64)
            if isinstance(x, torch.dtype) and x in _NARROW:  # .to(torch.float32), dtype=torch.float32
                return torch.float64
            return x

        if name in ("float", "half", "bfloat16") and args:  # a cast down would undo the promotion
            return up(args[0])
        if _INPLACE.match(name) and args:
            return func(args[0], *tree_map(up, tuple(args[1:])), **tree_map(up, kwargs))
        return func(*tree_map(up, tuple(args)), **tree_map(up, kwargs))


def _entries(index: Any, shape: torch.Size, grad: torch.Tensor | None, n_entries: int, seed: int) -> list[int]:
    numel = int(np.prod(shape)) if len(shape) else 1
    if index is None:
        if numel <= n_entries:
            return list(range(numel))
        picks = [int(grad.abs().argmax())] if grad is not None else []
        rng = np.random.default_rng(seed)
        for j in rng.permutation(numel):
            if len(picks) >= n_entries:
                break
            if int(j) not in picks:
                picks.append(int(j))
        return picks
    items = index if isinstance(index, list) else [index]
    flat = []
    for item in items:
        try:
            j = int(np.ravel_multi_index(item, tuple(shape))) if isinstance(item, tuple) else int(item)
        except (TypeError, ValueError) as exc:
            raise DiagnoseValueError(
                f"index {item!r} does not address an entry of a {tuple(shape)} tensor: {exc}"
            ) from None
        if not 0 <= j < numel:
            raise DiagnoseValueError(f"index {item!r} is outside a tensor of {numel} entries")
        flat.append(j)
    return flat


def check_derivative(
    closure: Callable[[], torch.Tensor],
    param: torch.Tensor,
    index: None | int | tuple[int, ...] | Sequence[Any] = None,
    eps: float = 1e-4,
    n_entries: int = 5,
    model: nn.Module | None = None,
    seed: int = 0,
    float64: bool = True,
) -> float:
    """Relative error between autograd's derivative of ``closure()`` with respect to chosen
    entries of ``param`` and central finite differences, both computed in float64.

    ``index``: a flat index, a tuple index, or a list of either; by default the entry with the
    largest gradient and random others (``n_entries`` in all, ``seed``). Each entry is moved by
    +-``eps * max(1, |p|)`` (the step actually stored in the parameter's dtype is the one used).
    With ``float64`` every operation of the closure runs in float64 (a TorchFunctionMode promotes
    float32/16 arguments), so a float32 model needs no change. Every closure call starts from the
    same random seed (dropout masks agree). A parameter with ``requires_grad=False`` is enabled
    for the check and disabled again; a gradient that does not exist counts as zero, so a
    severed path shows a relative error of 1 and an unused parameter 0. ``model``: its buffers
    (batch-norm statistics) are restored afterwards. Returns ||auto - fd|| / max(||auto||, ||fd||)
    over the entries (0 when both are zero).
    """
    check_closure(closure)
    if not isinstance(param, torch.Tensor) or not param.is_floating_point():
        raise DiagnoseTypeError(f"param must be a floating-point tensor, not {type(param).__name__}")
    if not param.is_leaf:
        raise DiagnoseValueError("param must be a leaf tensor (a parameter), not an intermediate result")
    if param.is_meta:
        raise DiagnoseValueError("param is on the meta device: it holds no values to differentiate")
    check_number("eps", eps)
    check_count("n_entries", n_entries)
    check_count("seed", seed, low=0)
    check_flag("float64", float64)
    if isinstance(index, bool) or (isinstance(index, (list, tuple)) and len(index) == 0):
        raise DiagnoseValueError(f"index={index!r} names no entry: give a flat index, a tuple index, "
                                 "a list of them, or None")
    if model is not None and not isinstance(model, nn.Module):
        raise DiagnoseTypeError(f"model must be a torch.nn.Module or None, not {type(model).__name__}")
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if model is not None else []
    mode = _Float64 if float64 else None

    def loss(with_grad: bool) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.set_grad_enabled(with_grad), (mode() if mode else contextlib.nullcontext()):
            return check_loss(closure())

    requires = param.requires_grad
    saved = param.detach().clone()
    try:
        with torch.random.fork_rng():
            param.requires_grad_(True)
            out = loss(True)
            grad = torch.autograd.grad(out, [param], allow_unused=True)[0] if out.requires_grad else None
            param.requires_grad_(requires)
            picks = _entries(index, param.shape, grad, n_entries, seed)
            auto = np.array([float(grad.reshape(-1)[j]) if grad is not None else 0.0 for j in picks])
            fd = np.zeros(len(picks))
            flat = param.data.view(-1) if param.is_contiguous() else None
            if flat is None:
                raise DiagnoseValueError("param must be contiguous for finite differences")
            for k, j in enumerate(picks):
                p0 = float(saved.reshape(-1)[j])
                h = eps * max(1.0, abs(p0))
                with torch.no_grad():
                    flat[j] = p0 + h
                    hi = float(flat[j])
                    plus = float(loss(False).detach().double())
                    flat[j] = p0 - h
                    lo = float(flat[j])
                    minus = float(loss(False).detach().double())
                    flat[j] = saved.reshape(-1)[j]
                fd[k] = (plus - minus) / (hi - lo)
    finally:
        with torch.no_grad():
            param.copy_(saved)
            for b, s in buffers:
                b.copy_(s)
        param.requires_grad_(requires)
    scale = max(np.linalg.norm(auto), np.linalg.norm(fd))
    return float(np.linalg.norm(auto - fd) / scale) if scale > 0 else 0.0
