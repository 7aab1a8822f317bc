"""The registry of derived signature metrics: ``@metric("name")`` on ``fn(records, window,
**params) -> float``. The families in ``signature/metrics/`` register here when imported;
``gradrepro.signature`` imports every family, so the names are known before any run.

A registered metric returns a number or NaN, never an exception: records that lack what it
reads (an empty run, a layer or column it does not have, a parameter it cannot use) give NaN,
and why is kept for the verdict's note (``why_nan``)."""

from __future__ import annotations

import functools
import math
from contextvars import ContextVar
from typing import Callable, Dict, Sequence, Tuple

MetricFn = Callable[..., float]
METRICS: Dict[str, MetricFn] = {}
# The recorded names a metric cannot do without (columns or constants a measurement records):
# validation refuses a check whose metric needs what the run's config does not switch on.
METRIC_NEEDS: Dict[str, Tuple[str, ...]] = {}
# Why the last metric that returned NaN for missing input did (the verdict shows it as a note).
why_nan: ContextVar[str] = ContextVar("why_nan", default="")


def metric(name: str, needs: Sequence[str] = ()) -> Callable[[MetricFn], MetricFn]:
    """Register a derived metric under ``name``; ``needs``: the recorded names it reads that
    only a measurement records."""

    def register(fn: MetricFn) -> MetricFn:
        if name in METRICS and getattr(METRICS[name], "__wrapped__", None) is not fn:
            raise ValueError(f"two signature metrics are named {name!r}")

        @functools.wraps(fn)
        def number_or_nan(records, window, **params) -> float:
            try:
                return float(fn(records, window, **params))
            except (LookupError, ValueError, ArithmeticError) as exc:
                why_nan.set(str(exc))
                return math.nan

        METRICS[name] = number_or_nan
        METRIC_NEEDS[name] = tuple(needs)
        return fn

    return register
