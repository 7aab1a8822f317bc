"""How many torch operations the probe dispatches on one logged step, against the bare step's
own count, and how many of them make the host wait for the device.

Counted with a ``TorchDispatchMode`` (every aten operation that reaches the dispatcher,
views included; a multi-tensor ``_foreach`` operation is one). On a GPU each operation is
at least one kernel launch, so on small models this count, not arithmetic, sets the probe's
cost. It is the same on CPU and CUDA (the probe has one path), so it is measured on CPU.

Host waits (``syncs``): ``aten._local_scalar_dense`` (``.item()``, ``float(tensor)``) and
copies that cross devices or go to the CPU explicitly (``_to_copy`` with a device, ``copy_``
between devices). The probe's one transfer is an explicit copy to the CPU even on a CPU
run, so that it is counted there too.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence

import torch
from tools import MODELS, Bare, ProbeTool, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched inside ``with OpCounter() as c:`` (``c.ops``), and
    those that wait for the device (``c.syncs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        self.syncs += _waits_for_device(func, args, kwargs)
        return func(*args, **kwargs)


def _waits_for_device(func, args, kwargs) -> bool:
    if func is _aten._local_scalar_dense.default:
        return True
    if func is _aten._to_copy.default and kwargs.get("device") is not None:
        target = torch.device(kwargs["device"])
        return target.type == "cpu" or target != args[0].device
    if func is _aten.copy_.default and torch.is_tensor(args[1]):
        return args[0].device != args[1].device
    return False


def count_step(tool, step: int) -> OpCounter:
    with OpCounter() as counter:
        tool.step(step)
    return counter


def ops_rows(models: Sequence[str], batch_sizes: Dict[str, int], warm_steps: int = 2) -> List[dict]:
    """Per model: ``bare_ops`` (one bare step), ``probe_ops`` and ``probe_syncs`` (what the
    probe adds to one logged step: the probe's step minus the bare step). Both tools first
    run ``warm_steps`` logged steps, so that the probe's buffers are laid out (the first
    logged step lays them out once; see probe/stash.py)."""
    rows = []
    for model in models:
        builder, shape, _, _ = MODELS[model]
        torch.manual_seed(0)
        base = builder()
        batch = make_batch(shape, batch_sizes[model])
        bare, probe = Bare(copy.deepcopy(base), batch), ProbeTool(copy.deepcopy(base), batch, every=1)
        for s in range(warm_steps):
            bare.step(s)
            probe.step(s)
        b, p = count_step(bare, warm_steps), count_step(probe, warm_steps)
        rows.append({"model": model, "tool": "gradrepro", "every": 1,
                     "batch": batch_sizes[model], "bare_ops": b.ops, "probe_ops": p.ops - b.ops,
                     "probe_syncs": p.syncs - b.syncs, "tensors": len(probe.probe.params),
                     "hooked_modules": len(probe.probe.hooked)})
    return rows
