"""Signatures: the checks on a run's records that decide whether the documented failure (or
health) showed up, evaluated as a pure function of the records (``evaluate``). Derived
metrics live in ``metrics/`` by family and register by name (``registry``); ``names`` says,
before a run starts, which metric names its records will hold."""

from gradrepro.signature.evaluate import (
    OPS,
    ROLES,
    CheckResult,
    Verdict,
    decide,
    evaluate,
    format_verdict,
    metric_ratio,
    observe,
    reduce_series,
)
from gradrepro.signature.registry import METRICS, metric

__all__ = ["METRICS", "OPS", "ROLES", "decide", "CheckResult", "Verdict", "evaluate", "format_verdict", "metric",
           "metric_ratio", "observe", "reduce_series"]
