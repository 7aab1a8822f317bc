"""Signature metrics of fp16 flush (Micikevicius et al. 2018, Sec. 3.2, Fig. 3): on the
activation-gradient histogram (``probe.act_grad_hist``), the share of non-zero values fp16
flushes as carried or at another loss scale; against the fp32 shadow of each logged step
(``probe.act_grad_reference``, gradrepro/measure/shadow_fp32.py), the values that were
non-zero in fp32 and carried as zeros, which real autocast shows too."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gradrepro.measure.shadow_fp32 import COLUMNS as SHADOW_COLUMNS
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


# --- against the fp32 shadow of each logged step (probe.act_grad_reference) ------------------


def _shadow_sums(records: RunRecords, window: int) -> pd.Series | None:
    """The shadow's counts summed over modules and the last ``window`` logged steps."""
    if "act_grad_lost" not in records.modules.columns:
        return None
    rows = _last_steps(records.modules, window).dropna(subset=["act_grad_lost"])
    return rows[list(SHADOW_COLUMNS)].sum() if len(rows) else None


def _share(sums: pd.Series | None, part: str, whole: str) -> float:
    if sums is None or sums[whole] <= 0:
        return math.nan
    return float(sums[part] / sums[whole])


@metric("act_grad_lost", needs=SHADOW_COLUMNS)
def act_grad_lost(records: RunRecords, window: int, of: str = "nonzero") -> float:
    """Of the activation gradients that are non-zero in fp32 (``of="nonzero"``), or of all
    sampled values (``of="all"``), the share this run carried as exact zeros, pooled over
    modules and the last ``window`` logged steps. fp32 arithmetic is its own reference (0)."""
    if of not in ("nonzero", "all"):
        raise ValueError(f"unknown of={of!r}: choose nonzero or all")
    return _share(_shadow_sums(records, window), "act_grad_lost",
                  "act_grad_ref_nonzero" if of == "nonzero" else "act_grad_ref_numel")


@metric("act_grad_ref_would_flush", needs=SHADOW_COLUMNS)
def act_grad_ref_would_flush(records: RunRecords, window: int, unscaled: bool = False) -> float:
    """Preflight from the fp32 shadow: of its non-zero activation gradients, the share at or
    below 2^-25 (what fp16 flushes) at the run's shift and loss scale, or at its shift alone
    (``unscaled``: as if the loss scale were 1)."""
    part = "act_grad_ref_small_unscaled" if unscaled else "act_grad_ref_small"
    return _share(_shadow_sums(records, window), part, "act_grad_ref_nonzero")


@metric("act_grad_flush_realised", needs=SHADOW_COLUMNS)
def act_grad_flush_realised(records: RunRecords, window: int) -> float:
    """Of the shadow's non-zero values at or below 2^-25 at the run's scale (those fp16 flushes
    at a module boundary), the share this run carried as zeros: near 1 in fp16 arithmetic
    (emulated or real), 0 in fp32; NaN where there are none (a scale that lifted them all)."""
    return _share(_shadow_sums(records, window), "act_grad_small_lost", "act_grad_ref_small")


@metric("act_grad_scale_kept", needs=SHADOW_COLUMNS)
def act_grad_scale_kept(records: RunRecords, window: int) -> float:
    """Of the shadow's non-zero values that would flush at loss scale 1, the share the run's
    loss scale lifted above 2^-25: 0 at scale 1, 1 when the scale keeps every one of them."""
    sums = _shadow_sums(records, window)
    kept = _share(sums, "act_grad_ref_small", "act_grad_ref_small_unscaled")
    return 1.0 - kept if math.isfinite(kept) else math.nan
