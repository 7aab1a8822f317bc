"""Signature metrics on the shape of a run's curves: steps to a target, growth, linearity,
ratios of two logged columns, a modules.parquet column reduced over steps.

Each is a pure function of one run's records: ``fn(records, window, **params) -> float``.
Comparisons with the run's reference runs are in ``runs.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric


def _window(df: pd.DataFrame, from_step: int | None, until_step: int | None) -> pd.DataFrame:
    """The rows of a records table (scalars or modules) with from_step <= step <= until_step."""
    if from_step is not None:
        df = df[df["step"] >= from_step]
    if until_step is not None:
        df = df[df["step"] <= until_step]
    return df


def _series(records: RunRecords, column: str, from_step: int | None = None,
            until_step: int | None = None) -> pd.DataFrame:
    return _window(records.scalars[["step", column]].dropna(), from_step, until_step)


@metric("steps_to")
def steps_to(records: RunRecords, window: int, column: str, target: float,
             smooth: int = 1, below: bool = False) -> float:
    """The first logged step at which the mean of the last ``smooth`` logged values of
    ``column`` reaches ``target`` (from below, or from above with ``below``: a loss);
    NaN when it never does (the check then fails)."""
    df = _series(records, column)
    running = df[column].rolling(int(smooth), min_periods=int(smooth)).mean()
    reached = df["step"][running <= float(target) if below else running >= float(target)]
    return float(reached.iloc[0]) if len(reached) else math.nan


@metric("progress_to")
def progress_to(records: RunRecords, window: int, column: str, target: float) -> float:
    """How far ``column`` went from its first logged value toward ``target``, as a fraction of
    the way: (first - last) / (first - target), ``last`` the mean of the last ``window`` logged
    values. 1: it reached the target (SimSiam's minimum loss -1); 0: it did not move; below 0:
    it went the other way (a diverging loss); 0.5: half-way, closer to neither end."""
    values = records.scalars[column].dropna() if column in records.scalars else pd.Series(dtype=float)
    if len(values) < 2:
        return math.nan
    first, last = float(values.iloc[0]), float(values.iloc[-window:].mean())
    span = first - float(target)
    return (first - last) / span if span != 0 else math.nan  # started at the target: undefined


@metric("growth")
def growth(records: RunRecords, window: int, column: str, from_step: int | None = None,
           until_step: int | None = None) -> float:
    """Least-squares line through ``column`` against step over [from_step, until_step]: its
    rise across the window in units of the line's value at the window's start. A quantity
    that grows linearly from g0 by g0 per step reads (steps in the window); a flat one ~0."""
    df = _series(records, column, from_step, until_step)
    if len(df) < 3:
        return math.nan
    slope, intercept = np.polyfit(df["step"].to_numpy(float), df[column].to_numpy(float), 1)
    start, end = float(df["step"].iloc[0]), float(df["step"].iloc[-1])
    base = slope * start + intercept
    return float(slope * (end - start) / abs(base)) if base != 0 else math.nan


@metric("linear_r2")
def linear_r2(records: RunRecords, window: int, column: str, from_step: int | None = None,
              until_step: int | None = None) -> float:
    """R^2 of the least-squares line through ``column`` against step over the window."""
    df = _series(records, column, from_step, until_step)
    if len(df) < 3:
        return math.nan
    x, y = df["step"].to_numpy(float), df[column].to_numpy(float)
    fit = np.polyval(np.polyfit(x, y, 1), x)
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - fit) ** 2).sum()) / total if total > 0 else math.nan


@metric("column_ratio")
def column_ratio(records: RunRecords, window: int, numerator: str, denominator: str,
                 from_step: int | None = None, until_step: int | None = None) -> float:
    """Median over the logged steps in the window of ``numerator / denominator``."""
    df = _window(records.scalars[["step", numerator, denominator]].dropna(), from_step, until_step)
    if df.empty:
        return math.nan
    return float((df[numerator] / df[denominator]).median())


@metric("module_column")
def module_column(records: RunRecords, window: int, column: str, reduce: str = "max",
                  from_step: int | None = None, until_step: int | None = None) -> float:
    """A ``modules.parquet`` column reduced (max, min, median, mean) over every tensor and
    logged step in the window, NaN values left out."""
    df = _window(records.modules[["step", column]].dropna(), from_step, until_step)
    if df.empty:
        return math.nan
    if reduce not in ("max", "min", "median", "mean"):
        raise ValueError(f"unknown reduce {reduce!r}: choose max, min, median or mean")
    return float(getattr(df[column], reduce)())
