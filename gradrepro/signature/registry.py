"""The registry of derived signature metrics: ``@metric("name")`` on ``fn(records, window,
**params) -> float``. The families in ``signature/metrics/`` register here when imported;
``gradrepro.signature`` imports every family, so the names are known before any run."""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

MetricFn = Callable[..., float]
METRICS: Dict[str, MetricFn] = {}
# The recorded names a metric cannot do without (columns or constants a measurement records):
# validation refuses a check whose metric needs what the run's config does not switch on.
METRIC_NEEDS: Dict[str, Tuple[str, ...]] = {}


def metric(name: str, needs: Sequence[str] = ()) -> Callable[[MetricFn], MetricFn]:
    """Register a derived metric under ``name``; ``needs``: the recorded names it reads that
    only a measurement records."""

    def register(fn: MetricFn) -> MetricFn:
        if name in METRICS and METRICS[name] is not fn:
            raise ValueError(f"two signature metrics are named {name!r}")
        METRICS[name] = fn
        METRIC_NEEDS[name] = tuple(needs)
        return fn

    return register
