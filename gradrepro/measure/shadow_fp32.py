"""The fp32 shadow of a logged step (``probe.act_grad_reference``): which activation gradients
that are non-zero in fp32 this run's arithmetic carried as exact zeros.

Under real autocast a flushed value is already an exact zero when anyone can look at it, so
"the share of values at or below 2^-25" reads 0 however much fp16 lost. What was lost can only
be seen against a reference: on a logged step, after the run's own backward and before its
optimizer step (the same weights, the same batch), the objective's loss is computed again in
fp32 (outside autocast and the emulation), times the run's shift and loss scale, and
differentiated to the same module outputs. Per module with parameters (the probe's modules):

- ``act_grad_ref_numel``: the sampled values (the first ``probe.act_sample`` rows);
- ``act_grad_ref_nonzero``: of those, non-zero in fp32;
- ``act_grad_ref_small``: non-zero in fp32 and at or below 2^-25 at the run's shift and scale
  (what fp16 flushes at a module boundary); ``act_grad_ref_small_unscaled``: the same at the
  shift alone (what it would flush at loss scale 1);
- ``act_grad_lost``: non-zero in fp32, carried as zero by the run; ``act_grad_small_lost``: of
  those, the ones at or below 2^-25;
- ``act_grad_gained``: zero in fp32 but not in the run (the forward differed: a ReLU mask
  flipped by fp16 rounding).

What it leaves alone: no ``.grad`` is written (``torch.autograd.grad``), every buffer (BatchNorm's
running statistics) is restored, and the global RNG is forked and set to the state the step's
forward started from, so dropout draws the same masks and training continues exactly as without
it (tested bit-identical). On steps that are not logged nothing of it runs.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from gradrepro.measure.base import Measurement, measurement
from gradrepro.recipe.precision import round_to_fp16

# The modules.parquet columns it records (NaN on a module it did not measure).
COLUMNS = ("act_grad_ref_numel", "act_grad_ref_nonzero", "act_grad_ref_small", "act_grad_ref_small_unscaled",
            "act_grad_lost", "act_grad_small_lost", "act_grad_gained")
FP16_FLUSH = 2.0**-25  # fp16 rounds |x| <= 2^-25 to zero (half the smallest subnormal, ties to even)


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    return out if torch.is_tensor(out) and out.requires_grad else None


@measurement
class ShadowFP32Measurement(Measurement):
    """``probe.act_grad_reference``: the fp32 shadow of each logged step (``ShadowFP32``)."""

    name = "shadow_fp32"
    switch = "probe.act_grad_reference=true"
    columns = COLUMNS

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return bool(cfg.probe.act_grad_reference)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        t = ctx.training
        self.shadow = ShadowFP32(t.probe.hooked, ctx.cfg.precision.mode, ctx.cfg.probe.act_sample)
        # Armed before the forward of a step logged by schedule; a step logged only because its
        # loss turned out non-finite (after the forward) has no shadow.
        self.armed = False

    def before_forward(self, p: Any) -> None:
        self.armed = True
        self.shadow.arm()

    def after_backward(self, p: Any, out: Any) -> None:
        if self.armed:
            self.shadow.disarm()

    def after_collect(self, p: Any, batch: Any) -> None:
        if self.armed:  # the same weights (before the step), outside autocast: fp32
            t = self.ctx.training
            self.shadow.compare(t.objective, t.net, batch, t.precision.shift, t.probe.loss_scale)

    def step_columns(self, p: Any) -> Dict[str, np.ndarray]:
        armed, self.armed = self.armed, False
        return self.shadow.columns(self.ctx.training.probe.module_of) if armed else {}


class ShadowFP32:
    """``arm()`` before a logged step's forward, ``disarm()`` after its backward, ``compare()``
    after the probe collected the gradients and before the optimizer step, ``columns()`` for
    the step's modules.parquet rows."""

    def __init__(self, modules: Dict[str, nn.Module], mode: str, sample: int) -> None:
        self.modules = modules
        self.emulated = mode == "fp16_emulated"
        self.sample = sample
        self.counts: Dict[str, torch.Tensor] = {}
        self._carried: Dict[str, torch.Tensor] = {}
        self._handles: List[Any] = []
        self._rng: Optional[torch.Tensor] = None
        self._cuda_rng: Optional[List[torch.Tensor]] = None

    def arm(self) -> None:
        """Before the forward: keep the RNG state it starts from, and hook each module's output
        so that the main backward's gradient there is kept as a carried-non-zero mask."""
        self._rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._carried.clear()
        self.counts.clear()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._capture(name)))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture(self, name: str) -> Callable:
        hooked = []

        def grad_hook(grad: torch.Tensor) -> None:
            if name in self._carried:  # the main backward only (a module called twice: its first call)
                return
            g = grad.detach()[: self.sample]
            # The emulation rounds at the module boundary, just after this hook sees the value.
            self._carried[name] = (round_to_fp16(g) if self.emulated else g) != 0

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            out = _first_tensor(output)
            if out is not None and not hooked:
                hooked.append(True)
                out.register_hook(grad_hook)

        return hook

    def compare(self, objective: Callable, net: nn.Module, batch: Any, shift: float, scale: float) -> None:
        """The fp32 reference of this step: the loss times ``shift * scale`` (as the run's backward
        had it), differentiated to the module outputs whose carried gradient was kept. Call it
        outside ``Precision.autocast()`` and before the optimizer step."""
        names = [n for n in self.modules if n in self._carried]
        if not names:
            return
        outputs: Dict[str, torch.Tensor] = {}

        def keep(name: str) -> Callable:
            def hook(module: nn.Module, inputs: Any, output: Any) -> None:
                out = _first_tensor(output)
                if out is not None and name not in outputs:
                    outputs[name] = out
            return hook

        handles = [self.modules[n].register_forward_hook(keep(n)) for n in names]
        saved = [b.detach().clone() for b in net.buffers()]
        cuda = [d for d in range(torch.cuda.device_count())] if self._cuda_rng is not None else []
        try:
            with torch.random.fork_rng(devices=cuda):
                torch.set_rng_state(self._rng)
                if self._cuda_rng is not None:
                    torch.cuda.set_rng_state_all(self._cuda_rng)
                loss = objective(net, batch).loss.float()
                reached = [n for n in names if n in outputs]
                grads = torch.autograd.grad(loss * (shift * scale), [outputs[n] for n in reached],
                                            allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for buffer, copy in zip(net.buffers(), saved):
                    buffer.copy_(copy)
        for name, grad in zip(reached, grads):
            self.counts[name] = self._count(self._carried[name], grad, scale)

    def _count(self, carried: torch.Tensor, grad: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        ref = torch.zeros(carried.shape, device=carried.device) if grad is None else grad.detach()[: self.sample]
        magnitude = ref.float().abs()
        nonzero = magnitude != 0
        small = nonzero & (magnitude <= FP16_FLUSH)
        small_unscaled = nonzero & (magnitude <= FP16_FLUSH * scale)
        lost = nonzero & ~carried
        counts = [nonzero.new_tensor(nonzero.numel(), dtype=torch.float64), nonzero.sum(), small.sum(),
                  small_unscaled.sum(), lost.sum(), (lost & small).sum(), (~nonzero & carried).sum()]
        return torch.stack([c.to(torch.float64) for c in counts])

    def columns(self, module_of: List[str]) -> Dict[str, np.ndarray]:
        """The counts as modules.parquet columns: one row per parameter tensor, in the probe's
        order (``module_of``: each row's module)."""
        nan = np.full(len(COLUMNS), np.nan)
        host = {name: c.cpu().numpy() for name, c in self.counts.items()}
        table = np.stack([host.get(m, nan) for m in module_of]) if module_of else np.zeros((0, len(COLUMNS)))
        return {col: table[:, j] for j, col in enumerate(COLUMNS)}
