"""Signature metrics on the activation-gradient histogram (``probe.act_grad_hist``): the
share of non-zero values fp16 flushes to zero, as carried or at another loss scale
(Micikevicius et al. 2018, Sec. 3.2, Fig. 3)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gradrepro.probe.kernels import HIST_COLUMNS, HIST_EDGES
from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric


def _hist_columns(modules: pd.DataFrame) -> list:
    return [c for c in HIST_COLUMNS if c in modules.columns]


def _last_steps(modules: pd.DataFrame, window: int) -> pd.DataFrame:
    """One row per (step, module) over the last ``window`` logged steps (weight and bias
    rows of a module carry the same activation statistics)."""
    steps = np.sort(modules["step"].unique())[-window:]
    rows = modules[modules["step"].isin(steps)]
    return rows.drop_duplicates(["step", "module"])


def flush_fraction(counts: pd.Series, at_scale_ratio: float = 1.0) -> float:
    """Of the non-zero values in a pooled histogram, the fraction that fp16 flushes to zero
    when the values are multiplied by ``at_scale_ratio`` (1: as carried). A value flushes
    when it is at most 2^-25; bins are [2^k, 2^(k+1)), so bins with 2^(k+1) <= 2^-25 flush
    whole (the bin [2^-25, 2^-24) keeps all but its lower edge, which is counted as kept)."""
    nonzero = counts.drop("act_grad_hist_zero").sum()
    if nonzero <= 0:
        return math.nan
    limit = -25 - math.log2(at_scale_ratio)  # flush when log2|g| < limit (to bin resolution)
    flushed = counts["act_grad_hist_below"]
    for k in HIST_EDGES[:-1]:
        if k + 1 <= limit:
            flushed += counts[f"act_grad_hist_{k}"]
    return float(flushed / nonzero)


@metric("act_grad_flush")
def act_grad_flush(records: RunRecords, window: int, at_scale: float | None = None, pooled: bool = True) -> float:
    """Fraction of non-zero activation gradients (all modules pooled, last ``window`` logged
    steps) that flush to zero in fp16. ``at_scale``: as if the loss scale had been this value
    instead of the run's (from the histogram; needs ``probe.act_grad_hist=true``). Without
    the histogram: the mean over modules of the probe's ``act_grad_frac_fp16_underflow``."""
    rows = _last_steps(records.modules, window)
    cols = _hist_columns(rows)
    if not cols or not pooled:
        if at_scale is not None:
            return math.nan
        return float(rows["act_grad_frac_fp16_underflow"].mean())
    counts = rows[cols].sum()
    ratio = 1.0
    if at_scale is not None:
        scale = records.scalars.set_index("step")["loss_scale"].reindex(rows["step"].unique()).mean()
        ratio = float(at_scale) / float(scale)
    return flush_fraction(counts, ratio)


@metric("act_grad_flush_vs_unscaled")
def act_grad_flush_vs_unscaled(records: RunRecords, window: int) -> float:
    """This run's flush fraction over the fraction that would flush at loss scale 1, on the
    same gradients: how much of the unscaled loss the scale recovered (0: all of it)."""
    scaled = act_grad_flush(records, window)
    unscaled = act_grad_flush(records, window, at_scale=1.0)
    return scaled / unscaled if unscaled > 0 else math.nan
