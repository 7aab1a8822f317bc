"""Signatures: the checks on a run's records that decide whether the documented failure (or
health) showed up, evaluated as a pure function of the records (``evaluate``). Derived
metrics live in ``metrics/`` by family and register by name (``registry``); ``names`` says,
before a run starts, which metric names its records will hold."""

from gradrepro.signature.evaluate import (
    DIFFERENCES,
    OPS,
    ROLES,
    TRANSFORMS,
    VERDICT_WORDS,
    CheckResult,
    Verdict,
    decide,
    evaluate,
    format_verdict,
    metric_ratio,
    observe,
    reduce_series,
    verdict_word,
)
from gradrepro.signature.quantity import quantity
from gradrepro.signature.registry import METRIC_NEEDS, METRICS, metric

__all__ = ["DIFFERENCES", "METRIC_NEEDS", "METRICS", "OPS", "ROLES", "TRANSFORMS", "VERDICT_WORDS", "CheckResult",
           "Verdict", "decide", "evaluate", "format_verdict", "metric", "metric_ratio", "observe", "quantity",
           "reduce_series", "verdict_word"]
