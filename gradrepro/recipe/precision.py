"""Numeric regime of the backward pass: fp32, real fp16 mixed precision, its emulation, or
pure bf16.

Read like nanoGPT's loop: the autocast context is chosen once; the loss is scaled before
backward and the gradients are divided (``unscale``) in fp32 before the probe, clipping
and the step. The parameters and optimizer state stay fp32 in every mode but bf16 ("master
weights", Micikevicius et al. 2018, Sec. 3.1).

Modes (``precision.mode``):

- ``fp32``: plain fp32.
- ``fp16``: real mixed precision, ``torch.autocast(device.type, float16)`` on CPU or CUDA.
- ``fp16_emulated``: fp32 arithmetic, but every module's output gradient and every weight
  gradient is rounded to fp16 and back (IEEE round-to-nearest-even, subnormals kept, values
  at or below 2^-25 flushed to zero, above 65504 to inf). The rounding sits at each module
  boundary, so the probe sees each gradient just before it is rounded: the fraction that
  flushes is measured per module, which real autocast cannot show (its zeros are already zero).
- ``bf16``: the parameters themselves are bf16 (no fp32 master unless asked for), and
  ``precision.bf16_update`` (nearest | stochastic | master) says how each update is written into
  them: ``recipe/bf16.py``. The only mode whose weights are not fp32.

Loss scale (``precision.loss_scale``): a number (static: the loss is multiplied by it, the
gradients divided by it in fp32, nothing is skipped) or ``dynamic`` (``torch.amp.GradScaler``:
init ``precision.scaler_init_scale``, growth 2 every ``precision.scaler_growth_interval`` clean
steps, backoff 0.5, skips a step whose gradients hold inf/NaN; PyTorch's defaults are 65536
and 2000). In fp32 a scale is applied the same way. The scaler's growths and back-offs are
counted (``growths``, ``backoffs``): the run records both beside the scale's path.

Shift knob (``precision.loss_shift``, c): the loss is multiplied by c before backward and
the weight gradients divided by c in fp32 after it. For c a power of two this is exact in
fp32 (bit-identical training, tested), but it moves every backward value by log2(c) octaves.
No experiment sets it: the precision experiments' regime comes from their loss
(objectives/dense_classification.py, experiments/precision.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from gradrepro.recipe.bf16 import BF16Weights

PRECISION_MODES = ("fp32", "fp16", "fp16_emulated", "bf16")


def round_to_fp16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest IEEE binary16 value, returned in ``t``'s dtype."""
    return t.to(torch.float16).to(t.dtype)


class RoundGradToFP16(torch.autograd.Function):
    """Identity forward; backward rounds the incoming gradient to fp16 and back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return round_to_fp16(grad)


def _round_output_grads(module: nn.Module, inputs, output):
    """Global forward hook: every leaf module's float output carries its gradient in fp16."""
    if next(module.children(), None) is not None:  # containers: their leaves already round
        return None
    if torch.is_tensor(output) and output.is_floating_point() and output.requires_grad:
        return RoundGradToFP16.apply(output)
    if isinstance(output, tuple):
        return tuple(
            RoundGradToFP16.apply(o) if torch.is_tensor(o) and o.is_floating_point() and o.requires_grad else o
            for o in output
        )
    return None


@contextlib.contextmanager
def emulate_fp16_backward() -> Iterator[None]:
    """Inside this context every module call's output gradient is rounded to fp16.
    A global hook runs before a module's own hooks, so the probe hooks the rounded tensor."""
    handle = nn.modules.module.register_module_forward_hook(_round_output_grads)
    try:
        yield
    finally:
        handle.remove()


def is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


class Precision:
    def __init__(self, cfg, device: torch.device) -> None:
        self.mode = cfg.mode
        self.dynamic = str(cfg.loss_scale) == "dynamic"
        self.static_scale = 1.0 if self.dynamic else float(cfg.loss_scale)
        self.shift = float(getattr(cfg, "loss_shift", 1.0))
        self.device = device
        self.scaler = None
        self.growths = 0  # times the dynamic scale grew (growth_interval clean steps in a row)
        self.backoffs = 0  # times it backed off (inf/NaN gradients: that step was skipped)
        self.bf16_update = str(getattr(cfg, "bf16_update", "nearest"))
        self.bf16: BF16Weights | None = None  # set by ``prepare`` in bf16 mode
        if self.mode != "fp32" and self.dynamic:
            # growth_factor 2 and backoff_factor 0.5 stay PyTorch's defaults.
            self.scaler = torch.amp.GradScaler(
                device.type,
                init_scale=float(getattr(cfg, "scaler_init_scale", 65536.0)),
                growth_interval=int(getattr(cfg, "scaler_growth_interval", 2000)),
            )

    def prepare(self, net: nn.Module, seed: int) -> None:
        """Put the network in this mode's parameter dtype (bf16 mode: bf16 weights and the
        update rule; every other mode keeps fp32 weights)."""
        if self.mode == "bf16":
            self.bf16 = BF16Weights(self.bf16_update, net, seed)

    def autocast(self) -> AbstractContextManager:
        if self.mode == "fp16":
            return torch.autocast(self.device.type, dtype=torch.float16)
        if self.mode == "fp16_emulated":
            return emulate_fp16_backward()
        return contextlib.nullcontext()

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else self.static_scale

    @property
    def skips_nonfinite(self) -> bool:
        """Whether non-finite gradients are an expected, skipped event (dynamic scaling)."""
        return self.scaler is not None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.shift != 1.0:
            loss = loss * self.shift
        if self.scaler is not None:
            self.scaler.scale(loss).backward(retain_graph=retain_graph)
        elif self.static_scale != 1.0:
            (loss * self.static_scale).backward(retain_graph=retain_graph)
        else:
            loss.backward(retain_graph=retain_graph)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.mode == "fp16_emulated" and grads:
            # Real autocast computes weight gradients in fp16 (then casts them to the fp32 master).
            torch._foreach_copy_(grads, [round_to_fp16(g) for g in grads])
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        elif self.static_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self.static_scale)
        if self.shift != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self.shift)  # exact for a power of two

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the scaler skipped the step."""
        if self.bf16 is not None:
            self.bf16.step(optimizer)
            return True
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        after = self.scaler.get_scale()
        self.growths += after > before
        self.backoffs += after < before
        return after >= before
