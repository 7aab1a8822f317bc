"""The probe: per-module gradient-signal statistics on logged steps (``probe.Probe``), its
kernels (``kernels``) and the gradient states it shares with ``diagnose`` (``states``)."""

from gradrepro.probe.probe import Probe, ProbeStep
from gradrepro.probe.states import FP16_FLUSH, GRAD_STATES, grad_states, module_kind

__all__ = ["FP16_FLUSH", "GRAD_STATES", "Probe", "ProbeStep", "grad_states", "module_kind"]
