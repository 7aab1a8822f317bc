"""Verdicts: a signature's checks on a run's own records, as a pure function of them.

An experiment's config carries ``signature.checks``: each names a metric, an operator and
a threshold. With ``params.relative_to: NAME`` a check compares the metric with the same
metric on a reference run (config ``references``: runs of other experiments that this run
makes itself, same seed, so the verdict still depends only on what this run recorded).
A metric is, in this order: a registered function of the records (``registry.METRICS``), a
column of ``scalars.parquet`` reduced over the last ``window`` logged values (or as
``params.reduce`` says), or a constant the run recorded once (``summary.constants``).

An observed value may be infinite (a non-zero value over an exact zero): it is a value and
is compared like any number (``inf >= x`` holds). NaN (nothing recorded, 0/0) holds nothing.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pandas as pd

import gradrepro.signature.metrics  # noqa: F401 - every family registers its metrics
from gradrepro.numerics import ratio
from gradrepro.records.run import RunRecords
from gradrepro.records.summary_schema import CLAIM_KINDS
from gradrepro.signature.quantity import quantity
from gradrepro.signature.registry import METRICS, why_nan

ROLES = ("evidence", "context")
OPS: Dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}


@dataclass
class CheckResult:
    metric: str
    observed: float
    op: str
    threshold: float
    ok: bool
    paper: Optional[str] = None
    note: str = ""
    params: Dict[str, Any] = field(default_factory=dict)  # how the metric was read
    role: str = "evidence"  # evidence decides the verdict; context is shown, never decisive
    # What ``observed`` is, as tables print it (``signature.quantity``): ``linear_acc gain``
    # for a check with ``reduce: change``, the metric itself where no param changes it.
    quantity: str = ""

    def __post_init__(self) -> None:
        if not self.quantity:
            self.quantity = quantity(self.metric, self.params)


@dataclass
class Verdict:
    reproduced: bool
    checks: List[CheckResult]

    def as_dicts(self) -> List[Dict[str, Any]]:
        return [asdict(c) for c in self.checks]


def reduce_series(values: pd.Series, how: str, window: int) -> float:
    """Reduce a logged scalar: ``last`` (mean of the last ``window`` values), ``first``,
    ``min``, ``max``, or ``change`` (last minus first)."""
    values = values.dropna()
    if values.empty:
        return math.nan
    if how == "last":
        return float(values.iloc[-window:].mean())
    if how == "first":
        return float(values.iloc[0])
    if how == "min":
        return float(values.min())
    if how == "max":
        return float(values.max())
    if how == "change":
        return float(values.iloc[-window:].mean() - values.iloc[0])
    raise ValueError(f"unknown reduce {how!r}: choose last, first, min, max or change")


def abs_log2(value: float) -> float:
    """|log2 x|: "within a factor of 2 of the derived value" as one check, |log2 x| <= 1, which
    fails on either side (two one-sided checks would each pass on one side of the interval)."""
    if value > 0:
        return abs(math.log2(value))
    return math.inf if value == 0 else math.nan


# ``params.transform``: applied to the observed value before the comparison.
TRANSFORMS: Dict[str, Callable[[float], float]] = {"abs_log2": abs_log2}

# ``params.how``: a metric against the same metric on a reference run (own, reference).
DIFFERENCES: Dict[str, Callable[[float, float], float]] = {
    "ratio": ratio,
    "difference": operator.sub,
    "abs_difference": lambda own, ref: abs(own - ref),
    "relative_difference": lambda own, ref: ratio(abs(own - ref), abs(ref)),
}


def observe(name: str, records: RunRecords, window: int, params: Dict[str, Any]) -> float:
    params = dict(params)
    transform = params.pop("transform", None)
    if transform is not None:
        if transform not in TRANSFORMS:
            raise ValueError(f"unknown transform {transform!r}: choose {', '.join(TRANSFORMS)}")
        return TRANSFORMS[transform](observe(name, records, window, params))
    window = int(params.pop("window", window))
    reference = params.pop("relative_to", None)
    if reference is not None:
        # The same metric on a reference run's records (e.g. the fp32 control), combined:
        # "final loss at least 2x fp32's" is loss / loss[fp32] >= 2.
        how = params.pop("how", "ratio")
        if reference not in records.references:
            raise KeyError(f"reference run {reference!r} not recorded")
        own = observe(name, records, window, params)
        ref = observe(name, records.references[reference], window, params)
        if how in DIFFERENCES:
            return DIFFERENCES[how](own, ref)
        raise ValueError(f"unknown how {how!r}: choose {', '.join(DIFFERENCES)}")
    if name in METRICS:
        return float(METRICS[name](records, window=window, **params))
    column = params.pop("column", name)
    if column in records.scalars.columns:
        value = reduce_series(records.scalars[column], params.pop("reduce", "last"), window)
        return value * float(params.pop("scale", 1.0))
    if column in records.constants:
        return float(records.constants[column])
    return math.nan


def metric_ratio(numerator: RunRecords, denominator: RunRecords, metric: str,
                 window: int = 3, **params) -> float:
    """One signature metric observed on two runs, as a ratio (e.g. steps to a target)."""
    return ratio(observe(metric, numerator, window, params), observe(metric, denominator, window, params))


def evaluate(signature: Any, records: RunRecords) -> Verdict:
    """Run every check of ``signature`` (a config node or dict) on ``records``; the verdict
    is decided by its evidence checks (``decide``)."""
    window = int(signature["window"]) if "window" in signature else 3
    results: List[CheckResult] = []
    for check in signature["checks"]:
        params = dict(check.get("params") or {})
        op = check["op"]
        threshold = float(check["threshold"])
        why_nan.set("")
        try:
            observed = observe(check["metric"], records, window, params)
            note = (why_nan.get() or "not recorded, or not a number") if math.isnan(observed) else ""
        except (LookupError, ValueError, ArithmeticError) as exc:  # a verdict never costs the records
            observed, note = math.nan, str(exc)
        ok = holds(observed, op, threshold)
        results.append(CheckResult(check["metric"], observed, op, threshold, ok, check.get("paper"),
                                   note, dict(check.get("params") or {}), check.get("role") or "evidence"))
    return Verdict(reproduced=decide(results), checks=results)


def holds(observed: float, op: str, threshold: float) -> bool:
    """Whether ``observed op threshold``. An infinite value is a value (a ratio over an exact
    zero: ``inf >= x`` holds); NaN (nothing recorded, 0/0) holds nothing."""
    return not math.isnan(observed) and bool(OPS[op](observed, threshold))


def decide(results: List[CheckResult]) -> bool:
    """Reproduced: at least one evidence check, and every evidence check held. Context checks
    are shown beside them and never decide."""
    evidence = [r for r in results if r.role == "evidence"]
    return bool(evidence) and all(r.ok for r in evidence)


# The verdict's word by claim kind (held, not held): a measurement reproduces a paper's result;
# a symptom demonstrates a mechanism, which no run of ours could refute; a measurement of our own,
# with nothing published to reproduce, is observed.
VERDICT_WORDS = {"empirical": ("REPRODUCED", "not reproduced"), "mechanism": ("DEMONSTRATED", "not demonstrated"),
                 "observation": ("OBSERVED", "not observed")}
# What each kind's verdict is about, printed beside it.
KIND_NOTES = {"empirical": "an empirical claim: a published measurement, measured again",
              "mechanism": "a mechanism: its symptom in the records, not a measurement of a paper's result",
              "observation": "an observation of ours: our own measurement, no published measurement behind it"}
assert set(VERDICT_WORDS) == set(KIND_NOTES) == set(CLAIM_KINDS)


def verdict_word(reproduced: Optional[bool], claim_kind: Optional[str]) -> str:
    """REPRODUCED / DEMONSTRATED (or their negations) for a claim of this kind; a run without a
    kind (a recording of the user's own loop) reads as empirical."""
    held, not_held = VERDICT_WORDS.get(claim_kind or "empirical", VERDICT_WORDS["empirical"])
    return held if reproduced else not_held


def format_verdict(verdict: Verdict, name: str, claim_kind: Optional[str] = "empirical") -> str:
    """The short table printed at the end of a run, headed by what the verdict proves. Each row
    names the quantity compared (``linear_acc gain``, not ``linear_acc``, for a gain) and its
    observed value."""
    rows = [
        {
            "quantity": c.quantity,
            "observed": "n/a" if math.isnan(c.observed) else f"{c.observed:.4g}",
            "check": f"{c.op} {c.threshold:.4g}",
            "role": c.role,
            "paper": c.paper or "",
            "ok": "yes" if c.ok else ("NO" if c.role == "evidence" else "no"),
        }
        for c in verdict.checks
    ]
    table = pd.DataFrame(rows).to_string(index=False) if rows else "(no checks)"
    kind = claim_kind or "empirical"
    head = f"{name}: signature {verdict_word(verdict.reproduced, kind)} ({KIND_NOTES.get(kind, kind)})"
    return f"{head}\n{table}"

