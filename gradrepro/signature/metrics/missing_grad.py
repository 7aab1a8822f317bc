"""Signature metrics of the ``missing_grad/*`` experiments that read the probe's records."""

from __future__ import annotations

import math

from gradrepro.records.run import RunRecords, parameter_names
from gradrepro.signature.registry import metric


@metric("probe_state_frac")
def probe_state_frac(records: RunRecords, window: int, name: str, state: str) -> float:
    """Fraction of logged steps at which the probe recorded ``state`` for parameter ``name``."""
    modules = records.modules
    if modules.empty:
        return math.nan
    rows = modules[parameter_names(modules) == name]
    return float((rows["grad_state"] == state).mean()) if len(rows) else math.nan
