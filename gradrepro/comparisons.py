"""Comparisons between runs, as pure functions of each run's own records.

A verdict reads one run's records; some claims are about two runs (a loss curve that looks
like another run's, steps to a target as a ratio). Those are computed here from the run
directories alone (``load_records``), never from a live process, so anyone can recompute
them from the folders: tests, experiment pages and ``compare`` call the same functions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from gradrepro import store
from gradrepro.signature import RunRecords, metric, observe


def load_records(run_dir: str | Path) -> RunRecords:
    """A run directory's records: scalars, modules and the constants of summary.json."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / store.SUMMARY).read_text())
    return RunRecords(
        pd.read_parquet(run_dir / store.SCALARS),
        pd.read_parquet(run_dir / store.MODULES),
        {k: (math.nan if v is None else v) for k, v in summary.get("constants", {}).items()},
    )


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


def metric_ratio(numerator: RunRecords, denominator: RunRecords, metric: str,
                 window: int = 3, **params) -> float:
    """One signature metric observed on two runs, as a ratio (e.g. steps to a target)."""
    top = observe(metric, numerator, window, params)
    bottom = observe(metric, denominator, window, params)
    return top / bottom if bottom else math.nan


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
