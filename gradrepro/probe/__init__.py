"""The probe: per-module gradient-signal statistics on logged steps (``probe.Probe``, one step
``step.ProbeStep``), in three parts: the hooks that gather (``hooks``), the buffers that hold
a logged step's blocks (``buffers``; the hooks' samples in ``stash``) and the reducer that
turns blocks into columns (``reducer``: block passes of ``blocks`` and ``kernels``, host sums
of ``columns``, the distributed sum of ``shards``). ``extras`` holds what only some
experiments configure; the gradient states are shared with ``diagnose`` (``states``)."""

from gradrepro.probe.probe import Probe
from gradrepro.probe.states import FP16_FLUSH, GRAD_STATES, grad_states, module_kind
from gradrepro.probe.step import ProbeStep

__all__ = ["FP16_FLUSH", "GRAD_STATES", "Probe", "ProbeStep", "grad_states", "module_kind"]
