"""The line printed under a verdict that did not hold: the experiment's page, and whether the page
gives the scale as the reason it may not reproduce here.

A page says it in one marker line (the page's own words follow ``why:``):

    <!-- not reproduced here: precision_fp16_noscale, precision_fp16_scale8; reason: scale; why: ... -->

``reason`` is ``scale`` (the page puts it down to our scale: model, data, budget) or ``other``.
A page without a marker for the experiment is named, with the line that it does not say."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import gradrepro

# The folder that holds the gradrepro package: a config's ``page`` is relative to it.
REPO = Path(gradrepro.__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- not reproduced here: (?P<names>[^;]+); reason: (?P<reason>scale|other); "
                    r"why: (?P<why>.*?) -->", re.S)
REASONS = ("scale", "other")


def page_reason(text: str, name: str) -> Optional[tuple]:
    """(reason, why) the page's marker gives for ``name``, or None."""
    for found in MARKER.finditer(text):
        if name in [n.strip().strip("`") for n in found.group("names").split(",")]:
            return found.group("reason"), " ".join(found.group("why").split())
    return None


def not_held_note(name: str, page: Optional[str], root: Path = REPO) -> str:
    """One line for a verdict that did not hold: where to read why."""
    if not page:
        return f"{name}: no page is named in its config"
    path = root / page
    try:
        text = path.read_text()
    except OSError:
        return f"{name}: see {page} (not found beside the package)"
    said = page_reason(text, name)
    if said is None:
        return f"{name}: see {page}; the page does not say whether the scale is the reason"
    reason, why = said
    if reason == "scale":
        return f"{name}: {page} gives the scale as the reason it may not reproduce here: {why}"
    return f"{name}: {page} gives a reason other than the scale: {why}"
