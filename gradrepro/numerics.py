"""One rule for quotients of measured values, used by every signature metric: a non-zero value
over an exact zero is infinitely large (a gradient that underflowed to exact zeros is infinitely
far below its reference), and that is a value; 0/0 and anything with NaN is NaN (nothing to
compare). summary.json writes an infinite value as the string "inf" or "-inf" and NaN as null
(records/files.py), and the reader turns them back into floats (records/reader.py)."""

from __future__ import annotations

import math


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, with x/0 = +-inf for x != 0 and 0/0 = NaN."""
    numerator, denominator = float(numerator), float(denominator)
    if math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    if denominator == 0:
        return math.copysign(math.inf, numerator) if numerator != 0 else math.nan
    return numerator / denominator
