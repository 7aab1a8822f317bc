"""Tensors a model holds that ``.to(device)`` did not move, and the device mismatch they cause.

``nn.Module.to`` moves registered parameters and buffers only. A layer kept in a plain list or
a trainable tensor kept in a plain attribute (the PyTorch guide "Diagnose missing gradients and
unchanged parameters": unregistered layers) stays where it was built, so on a GPU the first
forward pass fails with "Expected all tensors to be on the same device". On the CPU the same
model trains and the bug shows only as a layer that never updates. The device mismatch is
this bug's symptom on a GPU, so a run records it as its result (status ``device_mismatch``)
instead of stopping as bad input; the findings name the unregistered tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from gradrepro.diagnose.registration import normalize_name, scan_attributes
from gradrepro.errors import UserError


@dataclass
class DeviceMismatch:
    """The first forward pass failed because these tensors were not where the parameters are."""

    tensors: List[str]  # attribute paths, e.g. blocks.0 (a layer in a plain list), scale
    held_on: List[str]  # the device each of them is on
    device: str  # where the registered parameters are
    error: str  # the first line of the forward pass's error

    def as_dict(self) -> Dict[str, Any]:
        """summary.json's ``device_mismatch`` entry (its constants also get ``device_mismatch: 1``)."""
        return {"tensors": self.tensors, "held_on": self.held_on, "device": self.device, "error": self.error}


def parameter_device(net: nn.Module) -> Optional[torch.device]:
    first = next(net.parameters(), None)
    return None if first is None else first.device


def unmoved_tensors(net: nn.Module) -> Dict[str, torch.device]:
    """Path -> device of every unregistered tensor (or unregistered layer's parameter) the model
    holds in a plain attribute or container that is not on its registered parameters' device."""
    device = parameter_device(net)
    known = {id(p) for p in net.parameters()} | {id(b) for b in net.buffers()}
    found: Dict[str, torch.device] = {}
    for path, thing in scan_attributes(net, known)[0]:
        tensors = list(thing.parameters()) if isinstance(thing, nn.Module) else [thing]
        elsewhere = [t.device for t in tensors if t.device != device]
        if elsewhere:
            found[normalize_name(path)] = elsewhere[0]
    return found


def device_mismatch_at_first_forward(net: nn.Module, forward: Callable[[], None]) -> Optional[DeviceMismatch]:
    """Run ``forward`` (the build's check of one loss on one batch). When the model holds tensors
    ``.to(device)`` did not move and that forward fails, the failure is returned as the run's
    result; any other failure is raised as it is."""
    unmoved = unmoved_tensors(net)
    if not unmoved:
        forward()
        return None
    try:
        forward()
    except (RuntimeError, UserError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return DeviceMismatch(list(unmoved), [str(d) for d in unmoved.values()], str(parameter_device(net)), first)
    return None
