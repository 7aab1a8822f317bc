"""A gradient clip applied before a GradScaler unscaled the gradients, found in a run's
scalars (``grad_norm`` and ``loss_scale`` of each logged step).

``clip_grad_norm_(params, max_norm)`` on scaled gradients (scale S) leaves them at norm
``max_norm``; unscaling then hands the optimizer gradients of norm ``max_norm / S``. So the
recorded gradient norm times the loss scale is the same number at every logged step, while
the gradient norm itself moves with the scale. PyTorch's AMP examples unscale first
(https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-unscaled-gradients).

Decidable only when the scale took at least two values over the logged steps: under a
constant scale a clip after unscaling also gives a constant product.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from gradrepro.diagnose.report import ERROR, Finding

# clip_grad_norm_ scales by max_norm / (total + 1e-6): with scaled totals >= 1 the products
# agree to 1e-6 relative, and the probe's float32 block norms to ~1e-6 (kernels.py); 1e-4
# leaves room, and three unclipped steps agree that closely by chance with no practical odds.
RTOL = 1e-4
MIN_STEPS = 3


def clipped_while_scaled(scalars: pd.DataFrame) -> Optional[Finding]:
    if not {"grad_norm", "loss_scale", "step"} <= set(scalars.columns):
        return None
    rows = scalars[(scalars["loss_scale"] > 1) & np.isfinite(scalars["grad_norm"]) & (scalars["grad_norm"] > 0)]
    if len(rows) < MIN_STEPS or rows["loss_scale"].nunique() < 2:
        return None
    product = (rows["grad_norm"] * rows["loss_scale"]).to_numpy()
    centre = float(np.median(product))
    if not np.all(np.abs(product - centre) <= RTOL * centre):
        return None
    steps = rows["step"].to_numpy()
    return Finding("clipped_while_scaled", "gradients",
                   f"grad_norm x loss_scale = {centre:.6g} at every one of {len(rows)} logged steps "
                   f"(steps {steps[0]}..{steps[-1]}) while the scale changed: the gradients were clipped "
                   f"to {centre:.6g} before the GradScaler unscaled them, so the optimizer steps with "
                   f"{centre:.6g} / loss_scale; call scaler.unscale_(optimizer) before clipping", ERROR)
