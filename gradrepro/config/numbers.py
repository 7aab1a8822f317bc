"""Every number of a composed config, checked before any process starts: finite, not negative
where nothing negative means anything, within the range its consumer can hold.

The per-key checks of ``validate.py`` say what each knob means; this pass covers every numeric
key at once, including those a new experiment, data set or objective adds, so a NaN, an inf or
a 1e300 never reaches a process (``distributed.timeout_s=1e300`` overflows a timedelta,
``signature.checks.0.threshold=nan`` makes a check that can never hold)."""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterator, Tuple

from omegaconf import OmegaConf

from gradrepro.errors import UserError

# Keys where a negative number means something: a check's threshold and its parameters (a loss
# of -1, a target below zero). They are compared in float64, so any finite value is allowed.
# The paper's values are references, shown and never computed with.
SIGNED = ("signature.checks[*].threshold", "signature.checks[*].params.*", "paper.*")
# The parameters are float32: every other float beyond float32's largest finite value is inf there.
FLOAT32_MAX = 3.4028234663852886e38
# Whole numbers beyond 2**53 are not held exactly by float64 (numpy, the records, the tables).
INT_MAX = 2**53
# Ranges of their own (low, high, why): the process group's timeout is a timedelta, and a
# timeout shorter than a second ends the first collective before another process can answer.
RANGES = {
    "distributed.timeout_s": (1.0, 7 * 24 * 3600.0, "seconds: from 1 s to one week"),
    "model.dropout": (0.0, 1.0, "a probability: >= 0 and < 1"),
    "data.view_miss": (0.0, 1.0, "a probability: >= 0 and < 1"),
}
# Probabilities whose upper end is excluded: 1 would drop every unit, or every view's content.
BELOW_HIGH = ("model.dropout", "data.view_miss")


def numeric_leaves(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(key, value)`` for every int or float under ``node`` (a plain container), lists
    written ``key[i]`` as the other checks name them."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from numeric_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from numeric_leaves(v, f"{prefix}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix, node


def _matches(key: str, patterns: Tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(key, p.replace("[*]", "[[]*[]]")) for p in patterns)


def is_signed(key: str) -> bool:
    """Whether ``key`` takes any finite number, negative included (``SIGNED``)."""
    return _matches(key, SIGNED)


def check_number(key: str, value: Any) -> None:
    """One number of the config; UserError naming the key and the valid range."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key}={value} is not a finite number: give a number (every number of the "
                        "config must be finite)")
    if key in RANGES:
        low, high, why = RANGES[key]
        if not low <= value <= high or (key in BELOW_HIGH and value >= high):
            raise UserError(f"{key}={value} is out of range ({why})")
        return
    signed = is_signed(key)
    if value < 0 and not signed:
        raise UserError(f"{key}={value} must be >= 0: a negative value means nothing here")
    if isinstance(value, int) and abs(value) > INT_MAX:
        raise UserError(f"{key}={value} is too large: whole numbers up to 2**53 ({INT_MAX}) only")
    if isinstance(value, float) and not signed and abs(value) > FLOAT32_MAX:
        raise UserError(f"{key}={value} is outside float32's range (up to {FLOAT32_MAX:.4g}): "
                        "the model computes in float32, where it would be inf")


def check_numbers(cfg: Any) -> None:
    """Every numeric key of ``cfg`` (resolved), in the order the config lists them."""
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    for key, value in numeric_leaves({k: v for k, v in plain.items() if k != "hydra"}):
        check_number(key, value)


__all__ = ["check_number", "check_numbers", "is_signed", "numeric_leaves"]
