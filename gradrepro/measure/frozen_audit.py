"""The frozen audit: modules whose parameters are frozen (``train.freeze``), checked three
ways at the end of training (parameters, buffers and mode apart, as the PyTorch editorial
guide "Diagnose missing gradients and unchanged parameters" advises: "Check parameter,
buffer, and mode policies separately if a supposedly frozen model changes behavior").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gradrepro.measure.base import Measurement, measurement
from gradrepro.measure.mode_pass import relative_difference
from gradrepro.recipe.mode_policy import modes_kept

EXAMPLES = 256  # held-out examples whose pass records each frozen module's input


@measurement
class FrozenAuditMeasurement(Measurement):
    """``train.freeze``: the frozen modules' parameters, buffers and mode at the end, against
    their state before training (``FrozenAudit``)."""

    name = "frozen_audit"
    switch = "train.freeze=[MODULE,...]"
    constants = ("frozen_param_change", "frozen_buffer_change", "frozen_train_mode", "frozen_output_change")

    @staticmethod
    def enabled(cfg) -> bool:
        return bool(cfg.train.freeze)

    def before_training(self) -> dict[str, float]:
        t = self.ctx.training
        self.audit = FrozenAudit(t.net, t.frozen, t.data.eval_sets()[2][:EXAMPLES]) if t.frozen else None
        return {}

    def after_training(self, completed: bool) -> dict[str, float]:
        return self.audit.finish(self.ctx.training.net) if self.audit is not None else {}


class FrozenAudit:
    """Modules that own frozen parameters, checked three ways at the end of training:
    their parameters, their buffers and their mode, plus the change of their eval-mode
    output on the input they saw at the start (so a change of the layers before them does
    not count): with frozen parameters, only moved buffers can change that output."""

    def __init__(self, net: nn.Module, frozen: Sequence[str], x: torch.Tensor) -> None:
        owners = sorted({name.rpartition(".")[0] for name in frozen})
        self.modules = {name: net.get_submodule(name) for name in owners}
        self.params = {name: p.detach().clone() for name, p in net.named_parameters() if name in frozen}
        self.buffers = {f"{m}.{b}": t.detach().clone() for m, mod in self.modules.items()
                        for b, t in mod.named_buffers() if t.is_floating_point()}
        self.inputs: dict[str, torch.Tensor] = {}
        handles = [mod.register_forward_pre_hook(self._keep_input(name))
                   for name, mod in self.modules.items()]
        with modes_kept(net), torch.no_grad():
            net.eval()
            net(x)
        for h in handles:
            h.remove()
        self.outputs = self._outputs()

    def _keep_input(self, name: str):
        def hook(module, inputs):
            self.inputs[name] = inputs[0].detach().clone()
        return hook

    @torch.no_grad()
    def _outputs(self) -> dict[str, torch.Tensor]:
        outs = {}
        for name, mod in self.modules.items():
            if name in self.inputs:
                with modes_kept(mod):
                    mod.eval()
                    outs[name] = mod(self.inputs[name]).detach().clone()
        return outs

    def finish(self, net: nn.Module) -> dict[str, float]:
        params = dict(net.named_parameters())
        buffers = {f"{m}.{b}": t for m, mod in self.modules.items() for b, t in mod.named_buffers()}

        def change(now: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
            """L2 norm of the change of all the named tensors together."""
            if not start:
                return math.nan
            return math.sqrt(sum(float((now[n].detach().double() - t.double()).pow(2).sum())
                                 for n, t in start.items()))

        now = self._outputs()
        return {
            "frozen_param_change": change(params, self.params),
            "frozen_buffer_change": change(buffers, self.buffers),
            # Fraction of these modules in train mode at the end of training.
            "frozen_train_mode": float(np.mean([m.training for m in self.modules.values()])),
            # Relative change of their eval-mode output on the input they saw at the start.
            "frozen_output_change": max((relative_difference(now[n], o) for n, o in self.outputs.items()),
                                        default=math.nan),
        }
