"""Signature metrics that compare this run with its reference runs (config ``references``).

A verdict reads one run's records; some claims are about two runs (a loss curve that looks
like another run's). The reference runs are made by the run itself, into its own folder, so
these stay pure functions of what one run recorded; anyone can recompute them from the
folders (``gradrepro.records.read_run(path).records()``).
"""

from __future__ import annotations

import math

import numpy as np

from gradrepro.numerics import ratio
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
    return ratio(near, far)  # the curve of ``than`` itself: infinitely closer to it


@metric("accuracy_gap_se")
def accuracy_gap_se(records: RunRecords, window: int, reference: str, column: str = "test_acc",
                    absolute: bool = False) -> float:
    """This run's final ``column`` (an accuracy on the held-out set) minus the reference run's,
    in binomial standard errors of the reference's accuracy p on its n held-out examples,
    sqrt(p (1 - p) / n); n is the run constant ``n_test``. ``absolute``: the size of the gap.
    Two accuracies within 2 of these cannot be told apart on that set. A gap over a reference
    at exactly 0 or 1 (no spread) is +-inf, or 0 when there is no gap."""
    ref = records.references.get(reference)
    if ref is None:
        return math.nan
    own, base = _final(records, column), _final(ref, column)
    n = float(ref.constants.get("n_test", records.constants.get("n_test", math.nan)))
    gap = abs(own - base) if absolute else own - base
    se = math.sqrt(base * (1 - base) / n) if n > 0 and 0 <= base <= 1 else math.nan
    if se == 0:
        return 0.0 if gap == 0 else math.copysign(math.inf, gap)
    return gap / se


def _final(records: RunRecords, column: str) -> float:
    values = records.scalars[column].dropna() if column in records.scalars else None
    return float(values.iloc[-1]) if values is not None and len(values) else math.nan
