"""The registry of derived signature metrics: ``@metric("name")`` on ``fn(records, window,
**params) -> float``. The families in ``signature/metrics/`` register here when imported;
``gradrepro.signature`` imports every family, so the names are known before any run."""

from __future__ import annotations

from typing import Callable, Dict

MetricFn = Callable[..., float]
METRICS: Dict[str, MetricFn] = {}


def metric(name: str) -> Callable[[MetricFn], MetricFn]:
    """Register a derived metric under ``name``."""

    def register(fn: MetricFn) -> MetricFn:
        if name in METRICS and METRICS[name] is not fn:
            raise ValueError(f"two signature metrics are named {name!r}")
        METRICS[name] = fn
        return fn

    return register
