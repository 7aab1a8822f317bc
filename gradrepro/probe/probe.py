"""The probe: per-parameter and per-module gradient-signal metrics on logged steps.

One protocol, a context manager around the part of a training step the probe watches::

    with probe.step(step, lr=lr, loss_scale=scale) as p:   # hooks armed on logged steps
        out = objective(net, batch)
        if not finite(out.loss): p.log_anyway()            # record a step the schedule skipped
        backward(out.loss); p.contribution(out.terms)      # per loss term (optional)
        unscale(optimizer)
        p.collect()                                        # gradients, before clipping/step
        optimizer.step()
    columns = p.columns                                    # modules.parquet rows, or None

Three parts, each a small object: the hooks that gather (probe/hooks.py), the buffers that
hold a logged step's blocks (probe/buffers.py) and the reducer that turns blocks into columns
(probe/reducer.py, the distributed sum inside it). On steps that are not logged nothing runs
but the schedule's test. On a logged step the work does not grow operation by operation with
the number of tensors: the hooks copy their samples into a window-sized buffer (one operation
a sample), reduced a window at a time as they arrive (probe/stash.py); gradients, parameters
and updates pass with multi-tensor copies through the buffer of the parameters' pre-step copy,
reduced there over the whole layout at once (a window at a time where that copy lives in host
memory); each pass reduces every block in a fixed number of operations (probe/blocks.py), and
the per-block results reach the host in one transfer, where float64 sums by tensor finish them
(probe/columns.py). Gradient states
(probe/states.py): ``none``, ``zero``, ``tiny``, ``finite``, ``nonfinite``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np
from torch import nn

from gradrepro.probe.buffers import PARAM_ROWS, StepBuffers
from gradrepro.probe.hooks import Hooks
from gradrepro.probe.reducer import Reducer, step_norms, total_grad_norm
from gradrepro.probe.step import ProbeStep
from gradrepro.probe.tensors import ProbedTensors

__all__ = ["PARAM_ROWS", "Probe", "ProbeStep", "step_norms", "total_grad_norm"]


class Probe:
    """Collects the metrics of ``modules.parquet`` for one network."""

    def __init__(self, net: nn.Module, cfg, total_steps: Optional[int], weight_decay: float = 0.0) -> None:
        self.cfg = cfg
        self.total_steps = total_steps  # None: not known in advance (a user's own loop)
        self.tensors = ProbedTensors(net)
        self.names, self.params, self.hooked = self.tensors.names, self.tensors.params, self.tensors.hooked
        self.module_of = self.tensors.module_of
        self.reducer = Reducer(self.tensors, cfg, weight_decay)
        self.buffers = StepBuffers(self.tensors, self._before_on_host,
                                   self.reducer.act_window, self.reducer.act_grad_window)
        self.hooks = Hooks(self.tensors, cfg, self.buffers)
        self.lr = math.nan  # of the current step (update / lr reads as a gradient)
        self.summing = False  # this step adds to the running sum (probe.running_sum_steps)
        self.pending: Optional[dict] = None  # from collect to finish
        # True where the loop is not gradrepro's (the recorder): the carried part of .grad is
        # read when backward reaches each parameter, not at the step's first forward pass.
        self.carry_at_backward = False

    # -- settings the loop and the recorder read and write ------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.hooks.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.hooks.loss_scale = value

    @property
    def bf16(self) -> bool:
        """Whether the update's bf16 rounded-away count is measured (frac_bf16_update_lost)."""
        return self.reducer.bf16

    @bf16.setter
    def bf16(self, value: bool) -> None:
        self.reducer.bf16 = value

    @property
    def window_blocks(self) -> Optional[int]:
        return self.buffers.window_blocks

    @window_blocks.setter
    def window_blocks(self, value: Optional[int]) -> None:
        self.buffers.window_blocks = value

    @property
    def acts(self):
        return self.buffers.acts

    @property
    def act_grads(self):
        return self.buffers.act_grads

    def _before_on_host(self) -> bool:
        """probe.before_on: whether the pre-step copy of the parameters lives in host memory."""
        # The running-sum check's residuals read the whole update per tensor on the device.
        return getattr(self.cfg, "before_on", "device") == "host" and self.cfg.running_sum_steps == 0

    # -- the protocol -----------------------------------------------------------------------
    def logs(self, step: int) -> bool:
        """Every ``probe.every`` steps, the last step, and the running-sum window."""
        return (step % self.cfg.every == 0 or step == (self.total_steps or 0) - 1
                or step < self.cfg.running_sum_steps)

    def step(self, step: int, lr: float = math.nan, loss_scale: float = 1.0) -> ProbeStep:
        """The context manager for one training step (see the module docstring)."""
        return ProbeStep(self, step, lr, loss_scale, self.logs(step))

    def start(self, step: int, hooks: bool) -> None:
        """A logged step begins: forget the last one's statistics, arm the hooks, and keep
        what ``.grad`` holds before this step's backward (a running sum when nothing zeroed
        it), so that ``collect`` can tell the fresh gradient from the carried part."""
        self.buffers.begin()
        at_backward = self.carry_at_backward and hooks
        self.hooks.arm(activations=hooks, carry_at_backward=at_backward)
        self.summing = step < self.cfg.running_sum_steps
        if not at_backward:
            have, grads = self.tensors.grads()
            self.buffers.carry(have, grads)

    def contribute(self, terms) -> None:
        self.hooks.contribute(terms)

    def collect(self) -> None:
        """The gradients and parameters reduced: after backward, before the optimizer's step."""
        self.pending = self.reducer.collect(self.buffers, self.summing)

    def disarm(self) -> None:
        self.hooks.disarm()

    def finish(self, step: int) -> Optional[Dict[str, np.ndarray]]:
        """After the optimizer's step: the step's columns (None if ``collect`` never ran)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        return self.reducer.finish(self.buffers, self.hooks, step, pending, self.lr, self.summing)

    def release(self) -> None:
        """Nothing of the step's buffers is held until the next logged step."""
        self.buffers.release()
        self.reducer.release()
        self.hooks.clear()
        self.pending = None  # it refers to the step's gradients
