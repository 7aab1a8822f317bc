"""No threshold differs from its first committed value without a line on its page saying when,
why and what was looked at; and every check of every experiment is on its page.

The convention (README.md, "Pages"): each experiment page carries one marked table of the
checks of its experiments,

    <!-- thresholds: checked against the configs by tests/test_threshold_history.py -->
    | experiment | # | check | role | threshold | first committed | changed, why, what was looked at |
    | --- | --- | --- | --- | --- | --- | --- |
    | `bn_none` | 0 | `steps_to <=` | evidence | `${train.steps}` | `600` | 2026-11-30: ... |
    <!-- end of thresholds -->

``threshold`` is the config's value as written (a formula stays a formula), ``first committed``
the value the check had when it was first committed (from the configs' git history, written
down once: the test needs no git). Where the two differ, the last column must give the date
and the reason. An ``experiment`` cell may name several experiments that share their checks
(``a``, ``b``). A changed threshold in a config fails here until its page says so."""

from __future__ import annotations

import functools
import re
from typing import Dict, List, Tuple

import pytest
from conftest import ROOT, composed, experiment_names
from omegaconf import OmegaConf
from test_page_quotes import markdown_table

BEGIN = "<!-- thresholds: checked against the configs by tests/test_threshold_history.py -->"
END = "<!-- end of thresholds -->"
# Pages whose owner has not added the table yet (listed so that the gap is visible, not hidden).
WITHOUT_TABLE: set = set()
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@functools.lru_cache(maxsize=None)
def pages() -> Dict[str, List[str]]:
    """page -> the experiments whose config names it."""
    out: Dict[str, List[str]] = {}
    for name in experiment_names():
        out.setdefault(str(composed(name).page), []).append(name)
    return out


def _plain(value: str) -> str:
    return value.strip().strip("`").strip()


def same(a: object, b: object) -> bool:
    """Two thresholds as written: equal numbers, or the same formula."""
    a, b = _plain(str(a)), _plain(str(b))
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def table(text: str) -> List[dict]:
    assert BEGIN in text and END in text, f"no thresholds table: add one between {BEGIN!r} and {END!r}"
    rows = markdown_table(text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()).to_dict("records")
    out = []
    for row in rows:
        for name in re.findall(r"`([^`]+)`", row["experiment"]):
            out.append({**row, "experiment": name})
    return out


def checks(name: str) -> List[Tuple[str, str, str]]:
    """(check, role, threshold as written) of an experiment's composed signature."""
    raw = OmegaConf.to_container(composed(name).signature.checks, resolve=False)
    return [(f"{c['metric']} {c['op']}", c.get("role") or "evidence", str(c["threshold"])) for c in raw]


def problems(page: str, text: str, names: List[str]) -> List[str]:
    rows = {(r["experiment"], int(r["#"])): r for r in table(text)}
    out = []
    for name in names:
        for i, (check, role, threshold) in enumerate(checks(name)):
            row = rows.pop((name, i), None)
            where = f"{page}: {name} check {i} ({check} {threshold})"
            if row is None:
                out.append(f"{where}: not in the thresholds table")
                continue
            if _plain(row["check"]) != check or row["role"] != role or not same(row["threshold"], threshold):
                out.append(f"{where}: the table says {row['check']} {row['role']} {row['threshold']}, the config "
                           f"{check} {role} {threshold}")
            if not same(row["first committed"], threshold):
                why = row["changed, why, what was looked at"]
                if not DATE.search(why) or len(why) < 40:
                    out.append(f"{where}: differs from its first committed value {row['first committed']} and the "
                               "page does not say when, why and what was looked at")
    out += [f"{page}: {n} check {i} is in the table but not in the config" for n, i in rows]
    return out


@pytest.mark.parametrize("page", sorted(set(pages()) - WITHOUT_TABLE))
def test_every_threshold_is_on_its_page_with_its_history(page):
    assert problems(page, (ROOT / page).read_text(), pages()[page]) == []


def test_a_threshold_moved_without_a_line_fails():
    page, names = next((p, n) for p, n in sorted(pages().items()) if p not in WITHOUT_TABLE)
    text = (ROOT / page).read_text()
    row = table(text)[0]
    line = next(li for li in text.split(BEGIN, 1)[1].splitlines() if li.startswith("|") and row["check"] in li
                and f"`{row['experiment']}`" in li)
    cells = line.split("|")
    cells[5] = " `12345` "  # the config's threshold left as it is: the table no longer agrees
    cells[6] = " `12345` "  # and a first value that differs, with no history
    cells[7] = " "
    moved = text.replace(line, "|".join(cells), 1)
    found = problems(page, moved, names)
    assert any("the config" in p for p in found) and any("first committed" in p for p in found)


def test_the_pages_without_a_table_are_still_experiment_pages():
    assert WITHOUT_TABLE <= set(pages())
