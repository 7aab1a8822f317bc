"""Every empirical experiment's page names its development seeds (those any knob or threshold
was chosen on by looking at outcomes) and the seeds its reported numbers come from.

The convention (see experiments/simsiam.md): a section whose heading starts with
"## Development seeds" holds a line ``**Development seed(s): ...**`` naming the seeds (``0, 1``,
``0-4``) or saying ``none``, and a line ``**Report seeds: ...**`` that must equal the seeds the
reference report (``python -m gradrepro.report``) gives an empirical claim. No runs."""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import pytest
from conftest import ROOT, composed, experiment_names

from gradrepro.analysis.report import SEEDS_BY_KIND

_SEEDS = r"(none|\d+(?:\s*-\s*\d+)?(?:\s*,\s*\d+(?:\s*-\s*\d+)?)*)"


def empirical_pages() -> List[str]:
    return sorted({str(composed(n).page) for n in experiment_names()
                   if composed(n).claim_kind == "empirical"})


def section(text: str) -> Optional[str]:
    """The page's "## Development seeds..." section, up to the next level-2 heading."""
    m = re.search(r"^## Development seeds[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else None


def seeds(spec: str) -> Tuple[int, ...]:
    """``"0, 1"``, ``"100-104"`` or ``"none"`` as a tuple of seeds (empty for none)."""
    if spec.strip() == "none":
        return ()
    out: List[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


def named(body: str, label: str) -> Optional[Tuple[int, ...]]:
    m = re.search(rf"\*\*{label}: {_SEEDS}\.?\*\*", body)
    return seeds(m.group(1)) if m else None


def problems(page: str, text: str) -> List[str]:
    body = section(text)
    if body is None:
        return [f"{page}: no '## Development seeds' section"]
    out = []
    development = named(body, r"Development seeds?")
    report = named(body, "Report seeds")
    if development is None:
        out.append(f"{page}: the section names no development seeds (nor says 'none')")
    if report is None:
        out.append(f"{page}: the section names no report seeds")
    elif report != SEEDS_BY_KIND["empirical"]:
        out.append(f"{page}: report seeds {report} are not the report's {SEEDS_BY_KIND['empirical']}")
    if development and report and set(development) & set(report):
        out.append(f"{page}: development seeds {sorted(set(development) & set(report))} are report seeds")
    return out


def test_there_are_empirical_pages():
    assert "experiments/simsiam.md" in empirical_pages()
    assert len(empirical_pages()) >= 4


@pytest.mark.parametrize("page", empirical_pages())
def test_page_names_its_development_and_report_seeds(page):
    assert problems(page, (ROOT / page).read_text()) == []


def test_the_check_fails_on_a_page_without_the_section_or_with_other_seeds():
    good = "# P\n\n## Development seeds, report seeds\n\n- **Development seeds: 0, 1.** x\n" \
           "- **Report seeds: 100-104**, y\n\n## Next\n"
    assert seeds("0-2, 7") == (0, 1, 2, 7) and seeds("none") == ()
    assert problems("p", good) == []
    assert problems("p", "# P\n\n## Knobs\n")[0].endswith("no '## Development seeds' section")
    assert problems("p", good.replace("100-104", "100, 101"))
    assert problems("p", good.replace("0, 1.", "0, 101."))
    assert problems("p", good.replace("**Development seeds: 0, 1.**", "development seeds 0, 1"))
    # a seed line after the section does not count
    assert problems("p", good.replace("## Next\n", "").replace("## Development", "## Next\n\n## Development")
                    .replace("- **Report", "## Other\n- **Report"))
