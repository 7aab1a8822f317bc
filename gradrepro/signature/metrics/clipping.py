"""Signature metrics of the clipping experiments: what the optimizer stepped with, against the
threshold the clip was asked for (``train.grad_clip`` = c, passed as ``max_norm``).

``clip_grad_norm_`` leaves a clipped gradient at norm c N / (N + 1e-6) <= c (N its norm
before), and plain SGD (no momentum, no weight decay) steps by lr times that gradient; so a
clip that does what it was asked for bounds ``grad_norm`` by c and the update by lr c.
"""

from __future__ import annotations

import math

import numpy as np

from gradrepro.diagnose.scaled_clip import clipped_while_scaled
from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric

REDUCTIONS = ("median", "max", "min", "mean")


def _reduce(values: np.ndarray, how: str) -> float:
    if how not in REDUCTIONS:
        raise ValueError(f"unknown reduce {how!r}: choose {', '.join(REDUCTIONS)}")
    if not len(values):
        raise ValueError("no logged step with the values this metric reads")
    return float(getattr(np, how)(values))


@metric("scaled_clip_bound")
def scaled_clip_bound(records: RunRecords, window: int, max_norm: float) -> float:
    """The largest ``grad_norm x loss_scale / max_norm`` over the logged steps whose gradients
    are finite: at most 1 when the gradients were clipped to max_norm while they still carried
    the loss scale (the optimizer then steps with max_norm / loss_scale); the loss scale times
    an honestly clipped gradient's norm otherwise."""
    s = records.scalars
    rows = s[np.isfinite(s["grad_norm"]) & (s["grad_norm"] > 0) & np.isfinite(s["loss_scale"])]
    return _reduce((rows["grad_norm"] * rows["loss_scale"]).to_numpy(float), "max") / float(max_norm)


@metric("clipped_while_scaled")
def clipped_while_scaled_found(records: RunRecords, window: int) -> float:
    """1 where the recorder's finding ``clipped_while_scaled`` (diagnose/scaled_clip.py) names
    the run's records, 0 where it does not; NaN without the scalars it reads."""
    if not {"grad_norm", "loss_scale", "step"} <= set(records.scalars.columns):
        return math.nan
    return 1.0 if clipped_while_scaled(records.scalars) is not None else 0.0


def update_norms(records: RunRecords) -> np.ndarray:
    """Per logged step, the norm of the whole update: sqrt of the sum over tensors of
    (update_to_param x param_norm)^2 (the parameter norm before the step). A step at which a
    tensor's ratio is undefined (a zero parameter tensor) is left out."""
    m = records.modules
    if m.empty:
        return np.array([])
    u = (m["update_to_param"] * m["param_norm"]) ** 2
    per_step = u.groupby(m["step"]).agg(lambda v: np.sqrt(v.sum()) if np.isfinite(v).all() else np.nan)
    return per_step.dropna().to_numpy(float)


@metric("update_over_clip")
def update_over_clip(records: RunRecords, window: int, max_norm: float, lr: float, reduce: str = "median") -> float:
    """The update's norm over lr x max_norm, reduced over the logged steps (median, max, min,
    mean): at most 1 where plain SGD stepped with gradients clipped to max_norm."""
    return _reduce(update_norms(records), reduce) / (float(lr) * float(max_norm))
