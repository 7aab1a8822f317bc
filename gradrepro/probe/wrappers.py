"""What the recorder needs to know of how a user runs the model: the model inside the
wrappers that change its parameter names (DDP's ``module.``, ``torch.compile``'s
``_orig_mod.``), and whether bf16 is in play (bf16 weights, or bf16 autocast)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel, DataParallel and torch.compile's wrapper,
    so that the record's module names are the model's own whichever way it is run."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch._dynamo's OptimizedModule
        if inner is None and isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def has_bf16(params: Sequence[torch.Tensor]) -> bool:
    return any(p.dtype == torch.bfloat16 for p in params)


def autocast_bf16(param: torch.Tensor) -> bool:
    """Whether bf16 autocast is on for ``param``'s device type (torch >= 2.4 API, with the
    older per-device functions as the fallback)."""
    device_type = param.device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return False
        return torch.get_autocast_dtype(device_type) == torch.bfloat16
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        return False
    except (TypeError, AttributeError):  # pragma: no cover - older torch
        if device_type == "cuda":
            return torch.is_autocast_enabled() and torch.get_autocast_gpu_dtype() == torch.bfloat16
        return torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == torch.bfloat16


def is_compiled(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def run_eagerly() -> Optional[Callable[[], None]]:
    """Run torch.compile'd code eagerly until the returned function is called (torch >= 2.6's
    ``set_stance("force_eager")``; None where there is none): a logged step's hooks then see
    the model's own modules, at the cost of one uncompiled step."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    stance = set_stance("force_eager")
    return lambda: stance.__exit__(None, None, None)
