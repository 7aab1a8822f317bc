"""Signature metrics of pure-bf16 training (``measure/bf16_update.py``): what the update rule
delivered of the updates below half a bf16 ulp of their weight, and how many updates are that
small. Per parameter tensor the counts are pooled over the logged steps in the window (a small
bias sees few such entries a step: one step alone is noisy under stochastic rounding), then
reduced over tensors."""

from __future__ import annotations

import math

import numpy as np

from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric

REDUCES = ("min", "max", "median", "pooled")


def _pooled(records: RunRecords, numerator: str, denominator: str, reduce: str,
            from_step: int | None, until_step: int | None) -> float:
    if reduce not in REDUCES:
        raise ValueError(f"unknown reduce {reduce!r}: choose {', '.join(REDUCES)}")
    modules = records.modules
    if numerator not in modules or denominator not in modules:
        raise KeyError(f"{numerator} is not recorded (precision.mode=bf16 records it)")
    rows = modules[["step", "module", "param", numerator, denominator]].dropna()
    if from_step is not None:
        rows = rows[rows["step"] >= from_step]
    if until_step is not None:
        rows = rows[rows["step"] <= until_step]
    if rows.empty:
        return math.nan
    if reduce == "pooled":
        den = float(rows[denominator].sum())
        return float(rows[numerator].sum()) / den if den > 0 else math.nan
    sums = rows.groupby(["module", "param"])[[numerator, denominator]].sum()
    sums = sums[sums[denominator] > 0]  # a tensor without such updates says nothing
    if sums.empty:
        return math.nan
    shares = (sums[numerator] / sums[denominator]).to_numpy(float)
    return float({"min": np.min, "max": np.max, "median": np.median}[reduce](shares))


@metric("bf16_update_kept", needs=("bf16_update_kept_mass", "bf16_update_small_mass"))
def bf16_update_kept(records: RunRecords, window: int, reduce: str = "min", from_step: int | None = None,
                     until_step: int | None = None) -> float:
    """Of the update mass below half an ulp of its weight (sum of |u|), the share that reached
    the weights carried to the next step, per tensor over the logged steps, then ``reduce`` over
    tensors (``pooled``: one share over every tensor). Round to nearest keeps 0 of it (each such
    update rounds back to the old weight); unbiased stochastic rounding 1 in expectation."""
    return _pooled(records, "bf16_update_kept_mass", "bf16_update_small_mass", reduce, from_step, until_step)


@metric("bf16_update_small_share", needs=("bf16_update_small", "bf16_update_nonzero"))
def bf16_update_small_share(records: RunRecords, window: int, reduce: str = "pooled", from_step: int | None = None,
                            until_step: int | None = None) -> float:
    """Of the entries with a non-zero update, the share whose update is below half a bf16 ulp of
    their weight (the regime where round to nearest cancels it), per tensor over the logged
    steps, then ``reduce`` over tensors."""
    return _pooled(records, "bf16_update_small", "bf16_update_nonzero", reduce, from_step, until_step)


__all__ = ["bf16_update_kept", "bf16_update_small_share"]
