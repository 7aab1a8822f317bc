"""Signature metrics of the ``missing_grad/*`` experiments that read the probe's records."""

from __future__ import annotations

import math

import numpy as np

from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric


@metric("probe_state_frac")
def probe_state_frac(records: RunRecords, window: int, name: str, state: str) -> float:
    """Fraction of logged steps at which the probe recorded ``state`` for parameter ``name``."""
    modules = records.modules
    if modules.empty:
        return math.nan
    full = np.where(modules["module"] == "<root>", modules["param"], modules["module"] + "." + modules["param"])
    rows = modules[full == name]
    return float((rows["grad_state"] == state).mean()) if len(rows) else math.nan
