"""One training step as the probe sees it: ``Probe.step(...)`` returns a ``ProbeStep``, the
context manager of the protocol in probe/probe.py's docstring. On a step the schedule does
not log, every method is a test of ``logged`` and nothing else."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch


class ProbeStep:
    """The probe's part of one training step (``Probe.step``); ``columns`` after the block."""

    def __init__(self, probe: Any, step: int, lr: float, loss_scale: float, logged: bool) -> None:
        self.probe, self.step, self.logged = probe, step, logged
        self.columns: Optional[Dict[str, np.ndarray]] = None
        probe.lr, probe.loss_scale = lr, loss_scale

    def __enter__(self) -> "ProbeStep":
        if self.logged:
            self.probe.start(self.step, hooks=True)
        return self

    def log_anyway(self) -> None:
        """Record this step although the schedule skips it (called after the forward pass,
        before backward: a non-finite loss). Its activation statistics are not recorded."""
        if not self.logged:
            self.logged = True
            self.probe.start(self.step, hooks=False)

    def contribution(self, terms: Dict[str, torch.Tensor]) -> None:
        if self.logged:
            self.probe.contribute(terms)

    def collect(self) -> None:
        """Read the gradients: after backward (and unscaling), before clipping and the step."""
        if self.logged:
            self.probe.collect()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.probe.disarm()
        if self.logged and exc_type is None:
            self.columns = self.probe.finish(self.step)
        if self.logged:  # nothing of the step's buffers is held until the next logged step
            self.probe.release()
