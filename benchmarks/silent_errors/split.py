"""The benchmark's two halves, fixed by name: a case or healthy loop is in the DESIGN half (looked
at while the checks are built) or the SCORED half (run only to report), by the parity of the
first byte of the SHA-256 of its name. Deterministic, and blind to what a case contains."""

from __future__ import annotations

import hashlib

HALVES = ("design", "scored")


def half(name: str) -> str:
    return HALVES[hashlib.sha256(name.encode()).digest()[0] % 2]


def of_half(names, which: str | None) -> list:
    """``names`` in the half ``which`` (all of them for None or "all")."""
    return [n for n in names if which in (None, "all") or half(n) == which]
