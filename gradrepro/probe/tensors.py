"""The tensors a probe watches: every parameter of the network once (a tied weight is one
tensor), with its module, its name and its kind, and what the block buffers summarise of it
(``summarised``: a DTensor's shard, a sparse gradient as dense, a complex tensor as its real
and imaginary parts)."""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np
import torch
from torch import nn

from gradrepro.probe.shards import local, sharded_setup
from gradrepro.probe.states import module_kind


class ProbedTensors:
    """The parameters of ``net`` in module order, and per tensor its module, name and kind."""

    def __init__(self, net: nn.Module) -> None:
        self.names: List[str] = []
        self.params: List[torch.Tensor] = []
        self.module_of: List[str] = []
        self.param_of: List[str] = []
        self.kind_of: List[str] = []
        # The modules that hold parameters of their own: the forward hooks' modules.
        self.hooked: Dict[str, nn.Module] = {}
        for mod_name, module in net.named_modules():
            if any(True for _ in module.named_parameters(recurse=False)):
                self.hooked[mod_name] = module
        seen = set()
        for mod_name, module in net.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen:  # a tied weight is one tensor: record it once
                    continue
                seen.add(id(p))
                self.names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
                self.params.append(p)
                self.module_of.append(mod_name or "<root>")
                self.param_of.append(p_name)
                self.kind_of.append(module_kind(module))
        # A complex tensor is summarised as its real and imaginary parts (twice the entries).
        # A DTensor (FSDP2) as the shard this process holds: the buffers take the local
        # shapes, the columns the full tensor's entries (probe/shards.py combines the parts).
        self.shapes = [summarised(p).shape for p in self.params]
        self.numel = np.array([math.prod(p.shape) * (2 if p.is_complex() else 1) for p in self.params],
                              dtype=np.float64)
        self.local_numel = [math.prod(s) for s in self.shapes]
        self.plain_views = not (any(p.is_complex() for p in self.params)
                                or sharded_setup(self.params) is not None)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def wide(self) -> bool:
        """Whether a tensor is float64 (or complex128): the buffers are float64 then."""
        return any(p.dtype in (torch.float64, torch.complex128) for p in self.params)

    def values(self) -> List[torch.Tensor]:
        """What the buffers summarise of each parameter (the parameters themselves when every
        one is a plain real tensor)."""
        return self.params if self.plain_views else [summarised(p) for p in self.params]

    def grads(self) -> tuple:
        """(indices of the tensors with a gradient, those gradients as the buffers read them)."""
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        return have, [summarised(self.params[i].grad) for i in have]


def summarised(t: torch.Tensor) -> torch.Tensor:
    """What the probe summarises of a tensor: a DTensor's local shard, a sparse gradient
    (``nn.Embedding(sparse=True)``) as the dense tensor it stands for, a complex one as its
    real and imaginary parts (a view: the same norm, the update's norm included; zeros counted
    per part). Called under no_grad: no detach (it would be one more operation per tensor on
    every logged step)."""
    t = local(t)
    if t.is_sparse:
        t = t.to_dense()
    return torch.view_as_real(t) if t.is_complex() else t
