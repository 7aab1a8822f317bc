"""The types of summary.json (the run-folder contract in README.md), checked when a summary is
read back: a folder written by someone else is data, and a wrong type (checks as text, a
4000-digit step count, a list where a name belongs) is found here, with the field named,
instead of deep inside a table or a figure."""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Any, Callable, Dict, List

from gradrepro.records.files import INFINITIES

STATUSES = ("completed", "diverged", "interrupted", "failed", "running", "device_mismatch")
OPS = ("<=", "<", ">=", ">")
# What a verdict proves. empirical: a paper's measured result, REPRODUCED by a measurement that
# could have come out either way. mechanism: a documented behaviour (of PyTorch, of a bug, of a
# derivation), DEMONSTRATED by its symptom in the records and, where one exists, the detector
# that names it. observation: a measurement of our own that no paper published and no
# documentation states (its config says no published measurement exists), OBSERVED by a
# measurement that could have come out either way; nothing outside this repository is reproduced.
CLAIM_KINDS = ("empirical", "mechanism", "observation")
# Counts and indices in a summary are 64-bit at most (steps, seeds, stopped_at).
_MAX_INT = 2**63 - 1
_MAX_TEXT = 100_000
_MAX_ITEMS = 100_000


class SummaryError(ValueError):
    """A summary.json field of the wrong type; the message names the field."""


def _fail(where: str, expected: str, value: Any) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise SummaryError(f"'{where}' must be {expected}, not {type(value).__name__} {shown}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text(where: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        _fail(where, "text" + (" or null" if optional else ""), value)


def name(where: str, value: Any, optional: bool = False) -> None:
    """A name shown as one table cell: text without line breaks or control characters."""
    text(where, value, optional)
    if value is not None and (not value.isprintable() or len(value) > 1000):
        _fail(where, "a one-line name", value)


def number(where: str, value: Any, optional: bool = True) -> None:
    """A float or int; null for a value not measured (JSON has no NaN), "inf" or "-inf" for an
    infinite one (records/files.py)."""
    if (value is None and optional) or (isinstance(value, str) and value in INFINITIES):
        return
    if not is_number(value) or (isinstance(value, int) and abs(value) > _MAX_INT):
        _fail(where, "a number" + (" or null" if optional else ""), value)


def count(where: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        _fail(where, "a whole number >= 0" + (" or null" if optional else ""), value)


def flag(where: str, value: Any, optional: bool = True) -> None:
    if not (isinstance(value, bool) or (value is None and optional)):
        _fail(where, "true or false" + (" or null" if optional else ""), value)


def items(where: str, value: Any, kind: type, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, kind) or len(value) > _MAX_ITEMS:
        _fail(where, f"a {'list' if kind is list else 'mapping'}", value)


def scalar(where: str, value: Any) -> None:
    """A value shown in a cell: text, a number, true/false or null."""
    if value is None or isinstance(value, bool) or is_number(value):
        return
    text(where, value)


def plain(where: str, value: Any) -> None:
    """A scalar, or a list of scalars (a check's params, a paper's values)."""
    if isinstance(value, list):
        _each(where, value, scalar)
    else:
        scalar(where, value)


def _each(where: str, value: Any, check: Callable[[str, Any], None]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            check(f"{where}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check(f"{where}[{i}]", v)


def check_entry(where: str, check: Any) -> None:
    """One signature check as a summary records it (and as a recorded signature states it)."""
    items(where, check, dict, optional=False)
    name(f"{where}.metric", check.get("metric"))
    if check.get("op") not in OPS:
        _fail(f"{where}.op", f"one of {', '.join(OPS)}", check.get("op"))
    number(f"{where}.threshold", check.get("threshold"), optional=False)
    if isinstance(check.get("threshold"), float) and not math.isfinite(check["threshold"]):
        _fail(f"{where}.threshold", "a finite number", check["threshold"])
    number(f"{where}.observed", check.get("observed"))
    flag(f"{where}.ok", check.get("ok"))
    text(f"{where}.paper", check.get("paper"), optional=True)
    text(f"{where}.note", check.get("note"), optional=True)
    name(f"{where}.role", check.get("role"), optional=True)
    text(f"{where}.quantity", check.get("quantity"), optional=True)
    items(f"{where}.params", check.get("params"), dict)
    _each(f"{where}.params", check.get("params"), plain)


def signature_entry(where: str, signature: Any) -> None:
    """A resolved signature: ``{window, checks: [...]}`` with every value plain data."""
    items(where, signature, dict, optional=False)
    count(f"{where}.window", signature.get("window"))
    items(f"{where}.checks", signature.get("checks"), list, optional=False)
    for i, check in enumerate(signature["checks"]):
        check_entry(f"{where}.checks[{i}]", check)


def relative_folder(where: str, value: Any) -> None:
    """A folder inside the run folder: relative, no '..' (a reference run's ``run_dir``)."""
    name(where, value)
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\\" in value or not value.strip():
        _fail(where, "a folder inside the run folder", value)


def _reference(where: str, entry: Any) -> None:
    items(where, entry, dict, optional=False)
    name(f"{where}.experiment", entry.get("experiment"), optional=True)
    name(f"{where}.status", entry.get("status"), optional=True)
    number(f"{where}.wall_s", entry.get("wall_s"))
    if "run_dir" in entry:
        relative_folder(f"{where}.run_dir", entry["run_dir"])


def check_summary(summary: Any) -> Dict[str, Any]:
    """``summary`` unchanged if every field it has is of the contract's type; SummaryError
    naming the first field that is not. Fields it lacks are left to the reader's defaults."""
    if not isinstance(summary, dict):
        raise SummaryError(f"summary.json must hold a mapping, not {type(summary).__name__}")
    s = summary
    name("experiment", s.get("experiment"))
    if not s["experiment"].strip():
        _fail("experiment", "a name", s["experiment"])
    name("control", s.get("control"), optional=True)
    if "status" in s and s["status"] not in STATUSES:
        _fail("status", f"one of {', '.join(STATUSES)}", s["status"])
    flag("reproduced", s.get("reproduced"))
    count("seed", s.get("seed"))
    count("steps", s.get("steps"))
    count("stopped_at", s.get("stopped_at"))
    number("wall_s", s.get("wall_s"))
    text("claim", s.get("claim"), optional=True)
    if s.get("claim_kind") is not None and s["claim_kind"] not in CLAIM_KINDS:
        _fail("claim_kind", f"one of {', '.join(CLAIM_KINDS)}", s["claim_kind"])
    text("error", s.get("error"), optional=True)
    items("checks", s.get("checks"), list)
    for i, check in enumerate(s.get("checks") or []):
        check_entry(f"checks[{i}]", check)
    items("overrides", s.get("overrides"), list)
    _each("overrides", s.get("overrides"), name)
    items("constants", s.get("constants"), dict)
    _each("constants", s.get("constants"), lambda w, v: number(w, v) if not isinstance(v, bool) else None)
    items("paper", s.get("paper"), dict)
    _each("paper", s.get("paper"), plain)
    items("references", s.get("references"), dict)
    _each("references", s.get("references"), _reference)
    items("missing", s.get("missing"), list)
    _each("missing", s.get("missing"), text)
    if s.get("signature") is not None:
        signature_entry("signature", s["signature"])
    return summary


__all__: List[str] = ["CLAIM_KINDS", "STATUSES", "SummaryError", "check_entry", "check_summary", "signature_entry"]
