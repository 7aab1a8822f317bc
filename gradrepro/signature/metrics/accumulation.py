"""Signature metrics of gradient accumulation (``measure/full_batch_gradient.py``): how far the
accumulated gradient is from the full batch's, in units of what rounding alone could explain, and
how far a run's loss curve is from a reference run's (full-batch training)."""

from __future__ import annotations

import math

import numpy as np

from gradrepro.records.run import RunRecords
from gradrepro.signature.metrics.runs import curve_distance
from gradrepro.signature.registry import metric


@metric("accum_grad_over_rounding", needs=("accum_grad_rel_err", "accum_grad_rounding_bound"))
def accum_grad_over_rounding(records: RunRecords, window: int, reduce: str = "min",
                             from_step: int | None = None, until_step: int | None = None) -> float:
    """Per tensor and logged step, the accumulated gradient's relative difference from the full
    batch's over the largest difference rounding can make (``accum_grad_rounding_bound``),
    reduced over them (min, max, median). At most 1: the two are one sum, grouped differently;
    above 1: they are different sums."""
    if reduce not in ("min", "max", "median"):
        raise ValueError(f"unknown reduce {reduce!r}: choose min, max or median")
    modules = records.modules
    if "accum_grad_rel_err" not in modules or "accum_grad_rounding_bound" not in modules:
        raise KeyError("accum_grad_rel_err is not recorded (train.accumulate > 1 records it)")
    rows = modules[["step", "accum_grad_rel_err", "accum_grad_rounding_bound"]].dropna()
    if from_step is not None:
        rows = rows[rows["step"] >= from_step]
    if until_step is not None:
        rows = rows[rows["step"] <= until_step]
    rows = rows[rows["accum_grad_rounding_bound"] > 0]
    if rows.empty:
        return math.nan
    over = (rows["accum_grad_rel_err"] / rows["accum_grad_rounding_bound"]).to_numpy(float)
    return float({"min": np.min, "max": np.max, "median": np.median}[reduce](over))


@metric("curve_distance")
def curve_distance_to(records: RunRecords, window: int, reference: str, column: str = "loss",
                      until_step: int | None = None, log: bool = True) -> float:
    """Root-mean-square difference of this run's ``column`` (its log with ``log``) from reference
    run ``reference``'s over the logged steps both have (the same seed: the same batches)."""
    ref = records.references.get(reference)
    if ref is None:
        return math.nan
    return curve_distance(records, ref, column, until_step, log)
