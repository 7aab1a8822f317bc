"""Numeric regime of the backward pass: fp32, or fp16 autocast with loss scaling.

Read like nanoGPT's loop: the autocast context is chosen once; the scaler multiplies the
loss before backward and divides the gradients (``unscale``) before the probe and clipping.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PRECISION_MODES = ("fp32", "fp16")


class Precision:
    def __init__(self, cfg, device: torch.device) -> None:
        self.mode = cfg.mode
        self.dynamic = str(cfg.loss_scale) == "dynamic"
        self.static_scale = 1.0 if self.dynamic else float(cfg.loss_scale)
        self.device = device
        self.scaler = None
        if self.mode == "fp16" and self.dynamic:
            # GradScaler's defaults: init_scale 65536, growth 2, backoff 0.5, interval 2000.
            self.scaler = torch.amp.GradScaler(device.type)

    def autocast(self) -> ContextManager:
        if self.mode == "fp16":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else self.static_scale

    @property
    def skips_nonfinite(self) -> bool:
        """Whether non-finite gradients are an expected, skipped event (dynamic scaling)."""
        return self.scaler is not None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward(retain_graph=retain_graph)
        elif self.static_scale != 1.0:
            (loss * self.static_scale).backward(retain_graph=retain_graph)
        else:
            loss.backward(retain_graph=retain_graph)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        elif self.static_scale != 1.0:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.static_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the scaler skipped the step."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before
