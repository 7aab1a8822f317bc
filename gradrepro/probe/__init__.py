"""The probe: per-module gradient-signal statistics on logged steps (``probe.Probe``, one step
``step.ProbeStep``). The hooks' samples (``stash``), gradients and parameters are reduced in
block buffers (``blocks``) by numerical kernels (``kernels``) and finished on the host
(``columns``); ``extras`` holds what only some experiments configure; the gradient states
are shared with ``diagnose`` (``states``)."""

from gradrepro.probe.probe import Probe
from gradrepro.probe.states import FP16_FLUSH, GRAD_STATES, grad_states, module_kind
from gradrepro.probe.step import ProbeStep

__all__ = ["FP16_FLUSH", "GRAD_STATES", "Probe", "ProbeStep", "grad_states", "module_kind"]
