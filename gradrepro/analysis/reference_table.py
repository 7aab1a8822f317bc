"""What the committed reference table (``results/README.md``, written by ``python -m gradrepro.report``)
says each experiment's signature did: on how many of its seeds it held, and which seeds those
were. The README's experiment table shows it beside each claim, so that a claim is never read
without what reproduced here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

import gradrepro

RESULTS = Path(gradrepro.__file__).resolve().parent.parent / "results" / "README.md"
_HELD = re.compile(r"^(\d+)/(\d+) seeds")
_SEEDS = re.compile(r"seeds per experiment \(([\d, ]+)\)")


def _cells(row: str, width: int, free: Optional[int]) -> List[str]:
    """A pipe-table row's cells; surplus cells (an unescaped pipe in free text) go back into
    column ``free``."""
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
    extra = len(cells) - width
    if extra > 0 and free is not None:
        cells = cells[:free] + ["|".join(cells[free:free + extra + 1])] + cells[free + extra + 1:]
    return cells


def signature_held(path: Path = RESULTS) -> Dict[str, str]:
    """experiment -> ``held/n`` from the table of every check (``{}`` when there is no table)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    if "## Every check, over the seeds" not in text:
        return {}
    section = text.split("## Every check, over the seeds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    if len(rows) < 3:
        return {}
    head = _cells(rows[0], 0, None)
    if "experiment" not in head or "signature held" not in head:
        return {}
    free = head.index("paper") if "paper" in head else None
    out = {}
    for row in rows[2:]:
        cells = _cells(row, len(head), free)
        if len(cells) != len(head):
            continue
        found = _HELD.match(cells[head.index("signature held")])
        if found:
            out[cells[head.index("experiment")]] = f"{found.group(1)}/{found.group(2)}"
    return out


def report_seeds(path: Path = RESULTS) -> str:
    """The seeds the report's header names (``100, 101``), or ``""``."""
    try:
        found = _SEEDS.search(path.read_text())
    except OSError:
        return ""
    return found.group(1) if found else ""
