"""The line under a verdict that did not hold names the experiment's page and whether the page gives
the scale as the reason; every page's markers name its own experiments, and every failure that
did not reproduce in results/README.md on a page that gives reasons has one."""

from __future__ import annotations

import pytest
from conftest import ROOT, composed, experiment_names
from test_results_current import NOT_REPRODUCED_ON_THE_REPORT_SEEDS

from gradrepro.train.page_note import MARKER, not_held_note, page_reason

# Pages whose owner has not written their reasons as markers yet: the line says so.
WITHOUT_MARKERS: set = set()


def test_the_note_says_scale_other_or_that_the_page_does_not_say(tmp_path):
    (tmp_path / "page.md").write_text(
        "<!-- not reproduced here: a, b; reason: scale; why: too small\n a model -->\n"
        "<!-- not reproduced here: c; reason: other; why: noise -->\n")
    assert page_reason((tmp_path / "page.md").read_text(), "b") == ("scale", "too small a model")
    assert not_held_note("a", "page.md", tmp_path) == (
        "a: page.md gives the scale as the reason it may not reproduce here: too small a model")
    assert not_held_note("c", "page.md", tmp_path) == "c: page.md gives a reason other than the scale: noise"
    assert not_held_note("d", "page.md", tmp_path) == (
        "d: see page.md; the page does not say whether the scale is the reason")
    assert "not found" in not_held_note("a", "gone.md", tmp_path)


@pytest.mark.parametrize("page", sorted({str(composed(e).page) for e in experiment_names()}))
def test_a_pages_markers_name_its_own_experiments(page):
    for found in MARKER.finditer((ROOT / page).read_text()):
        for name in (n.strip() for n in found.group("names").split(",")):
            assert name in experiment_names() and str(composed(name).page) == page, f"{page} marks {name}"


@pytest.mark.parametrize("name", sorted(NOT_REPRODUCED_ON_THE_REPORT_SEEDS))
def test_each_failure_that_did_not_reproduce_has_its_pages_reason(name):
    page = NOT_REPRODUCED_ON_THE_REPORT_SEEDS[name]
    if page in WITHOUT_MARKERS:
        assert "does not say" in not_held_note(name, page)
        return
    assert page_reason((ROOT / page).read_text(), name), f"{page} gives no reason for {name} in a marker"
