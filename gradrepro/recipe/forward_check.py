"""The first forward pass, before training: one loss on one batch in eval mode and one in
train mode, so that a model, objective and data that do not fit are one line naming what
went wrong (a device, dtype or shape mismatch, a batch too small for batch statistics, labels
beyond the model's classes), with the devices, dtypes and shapes involved, never a traceback
at step 0. Nothing changes: buffers and random state are restored, no gradient is kept."""

from __future__ import annotations

import re
from typing import Any, Iterable, List, Optional

import torch
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.diagnose.registration import scan_attributes
from gradrepro.errors import UserError, first_line
from gradrepro.recipe.mode_policy import modes_kept


def check_forward(objective: Any, net: nn.Module, data: ImageData, seed: int) -> None:
    """Both modes the run uses: eval (evaluations) and train (every step: batch statistics
    need more than one value per channel). Raises UserError with what went wrong."""
    batch = data.sample(torch.Generator().manual_seed(seed))
    buffers = [(b, b.detach().clone()) for b in net.buffers()]
    devices = [net_device(net)] if net_device(net).type == "cuda" else []
    try:
        with modes_kept(net), torch.no_grad(), torch.random.fork_rng(devices=devices):
            for training in (False, True):
                net.train(training)
                objective(net, batch)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, NotImplementedError) as exc:
        raise UserError(describe_forward_error(exc, net, batch)) from None
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def net_device(net: nn.Module) -> torch.device:
    first = next(iter(net.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


_KINDS = (  # (what went wrong, how torch says it), first match wins
    ("a batch of one example cannot train BatchNorm layers (batch statistics need more than one "
     "value per channel; raise data.batch_size and data.n_train to 2 or more)", r"more than 1 value per channel"),
    ("labels beyond the model's outputs (data.num_classes and model.num_classes must agree)",
     r"target -?\d+ is out of bounds|out of bounds.*target|device-side assert"),
    ("a device mismatch", r"same device|device type|expected device|on the (?:meta|cuda|cpu)|"
                          r"found at least two devices|tensor on device"),
    ("a dtype mismatch", r"dtype|scalar type|expected .*(?:float|double|half)"),
    ("a shape mismatch", r"shape|size mismatch|cannot be multiplied|size of tensor|sizes of tensors|"
                         r"expected input|must match the size|dimension"),
)


def kind_of(exc: BaseException) -> Optional[str]:
    text = str(exc)
    types = re.search(r"Input type \((\S+)\) and weight type \((\S+)\)", text)
    if types:  # conv layers say both in one message: cuda on one side only is a device mismatch
        a, b = types.groups()
        return "a device mismatch" if (".cuda." in a) != (".cuda." in b) else "a dtype mismatch"
    for kind, pattern in _KINDS:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return kind
    return None


def _tensors(values: Iterable[torch.Tensor]) -> str:
    seen = sorted({f"{t.device} {str(t.dtype).replace('torch.', '')}" for t in values})
    return ", ".join(seen) or "none"


def describe_forward_error(exc: BaseException, net: nn.Module, batch: Batch) -> str:
    """One line: what went wrong, torch's own words, and the devices, dtypes and shapes of
    the network's tensors and the batch (and of tensors the network holds unregistered:
    ``.to(device)`` does not move those)."""
    kind = kind_of(exc)
    parts: List[str] = [f"the first forward pass failed: {kind}: {first_line(exc)}" if kind
                        else f"the first forward pass failed: {first_line(exc)}"]
    if kind in ("a device mismatch", "a dtype mismatch", "a shape mismatch"):
        state = list(net.parameters()) + list(net.buffers())
        inputs = [t for t in batch if isinstance(t, torch.Tensor)]
        facts = [f"model parameters and buffers on {_tensors(state)}",
                 "batch " + "; ".join(f"{tuple(t.shape)} {t.device} {str(t.dtype).replace('torch.', '')}"
                                      for t in inputs)]
        unregistered, _ = scan_attributes(net, {id(p) for p in net.parameters()})
        loose = [f"{name} ({_tensors([value] if isinstance(value, torch.Tensor) else value.parameters())})"
                 for name, value in unregistered[:3]]
        if loose:
            facts.append("held but not registered (not moved by .to(device)): " + ", ".join(loose))
        parts.append("(" + "; ".join(facts) + ")")
    return " ".join(parts)
