"""Signature metrics of the train/eval-mode family: the mode pass (measure/mode_pass.py)
records each quantity twice, in the chosen mode and in eval mode (the deployed function);
these compare the two."""

from __future__ import annotations

import math

from gradrepro.numerics import ratio
from gradrepro.records.run import RunRecords
from gradrepro.signature.registry import metric


@metric("constant_ratio")
def constant_ratio(records: RunRecords, window: int, numerator: str, denominator: str) -> float:
    """constants[numerator] / constants[denominator], e.g. the held-out loss of a pass in
    train mode over the same loss in eval mode (``diag_loss`` / ``diag_loss_ref``): 1 when the
    two modes compute the same function. x/0 is inf for x > 0; NaN when either is missing."""
    return ratio(records.constants.get(numerator, math.nan), records.constants.get(denominator, math.nan))
