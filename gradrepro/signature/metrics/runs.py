"""Signature metrics that compare this run with its reference runs (config ``references``).

A verdict reads one run's records; some claims are about two runs (a loss curve that looks
like another run's). The reference runs are made by the run itself, into its own folder, so
these stay pure functions of what one run recorded; anyone can recompute them from the
folders (``gradrepro.records.read_run(path).records()``).
"""

from __future__ import annotations

import math

import numpy as np

from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric


def curve_distance(a: RunRecords, b: RunRecords, column: str = "loss",
                   until_step: int | None = None, log: bool = True) -> float:
    """Root-mean-square difference of ``column`` (its log with ``log``) between two runs over
    the logged steps both have, up to ``until_step``. Runs with the same seed sample the
    same batches, so their per-batch losses are compared batch for batch."""
    left = a.scalars[["step", column]].dropna()
    right = b.scalars[["step", column]].dropna()
    both = left.merge(right, on="step", suffixes=("_a", "_b"))
    if until_step is not None:
        both = both[both["step"] <= until_step]
    if both.empty:
        return math.nan
    x, y = both[f"{column}_a"].to_numpy(float), both[f"{column}_b"].to_numpy(float)
    if log:
        x, y = np.log(x), np.log(y)
    return float(np.sqrt(np.mean((x - y) ** 2)))


@metric("curve_distance_ratio")
def curve_distance_ratio(records: RunRecords, window: int, closer_to: str, than: str,
                         column: str = "loss", until_step: int | None = None, log: bool = True) -> float:
    """This run's curve distance to reference ``closer_to`` over its distance to reference
    ``than`` (below 1: it looks more like the first), e.g. a forgotten zero_grad's early loss
    curve against a raised-learning-rate lookalike and against its own control."""
    refs = records.references
    if closer_to not in refs or than not in refs:
        return math.nan
    near = curve_distance(records, refs[closer_to], column, until_step, log)
    far = curve_distance(records, refs[than], column, until_step, log)
    return near / far if far else math.nan
