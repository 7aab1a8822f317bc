"""The report's section on what its verdicts prove, computed from the runs it read: how many
experiments make each kind of claim, how many checks are evidence and context, and for every
failure each check against its control over the seeds (the margins table), with the checks
that did not hold on the failure or did not fail on the control named in sentences.

The section carries the hash of the configs and signature code that judged the runs
(``records.provenance.source_hash``) in a marker line, so a test can tell a table made by other
configs or other signature code from a current one. Where the code moved on and the table was not
made again, ``stale_notice`` puts a visible notice at the top of the file that says so, names the
code it stands beside by that code's hash, and says what changed; a regenerated report has none."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

import pandas as pd

from gradrepro.analysis.fit_width import markdown
from gradrepro.records.reader import Run

MARKER = "<!-- judged by configs and signature code with source hash {hash} -->"
MARKER_PATTERN = re.compile(r"<!-- judged by configs and signature code with source hash ([0-9a-f]+) -->")
SHOWN = ("experiment", "control", "claim_kind", "check", "role", "op", "threshold", "seeds", "holds_on_failure",
         "fails_on_control", "control_n/a", "min_margin_failure", "at_seed_failure", "min_margin_control",
         "at_seed_control")


STALE_MARKER = "<!-- stale: these tables are older than the code with source hash {hash} -->"
STALE_PATTERN = re.compile(
    r"<!-- stale: these tables are older than the code with source hash ([0-9a-f]+) -->\n(.*?)\n\n", re.S)


def stale_hash(text: str) -> Optional[str]:
    """The source hash a report's stale notice was written beside, or None if it has none."""
    found = STALE_PATTERN.search(text)
    return found.group(1) if found else None


def stale_notice(text: str, source: str, why: str) -> str:
    """``text`` with its stale notice (any earlier one replaced) after its first paragraph: the
    tables below were judged by the code with hash ``recorded_hash(text)``, not by ``source``."""
    text = STALE_PATTERN.sub("", text)
    notice = (f"{STALE_MARKER.format(hash=source)}\n**These tables are out of date.** They were made by "
              f"the configs and signature code with source hash {recorded_hash(text)}; the package's "
              f"now have source hash {source}. What changed since: {why.strip()} Until "
              "`python -m gradrepro.report` makes them again, read each number as the earlier code's.\n\n")
    head, sep, rest = text.partition("\n\n")
    second, sep2, tail = rest.partition("\n\n")
    return head + sep + second + sep2 + notice + tail


def recorded_hash(text: str) -> Optional[str]:
    """The source hash a report's text names, or None."""
    found = MARKER_PATTERN.search(text)
    return found.group(1) if found else None


def _kinds(runs: Sequence[Run]) -> Dict[str, str]:
    """experiment -> claim kind, from the runs' summaries (reference runs are not read)."""
    return {run.experiment: str(run.summary.get("claim_kind")) for run in runs}


def counts_sentences(runs: Sequence[Run]) -> List[str]:
    """Experiments by claim kind, and evidence and context checks of failures and of controls."""
    kinds = _kinds(runs)
    by_kind = pd.Series(kinds).value_counts()
    checks: Dict[str, Dict[str, int]] = {"failures": {}, "controls and healthy runs": {}}
    seen = set()
    for run in runs:
        if run.experiment in seen:
            continue
        seen.add(run.experiment)
        side = checks["failures" if run.control else "controls and healthy runs"]
        for check in run.summary.get("checks") or []:
            role = str(check.get("role") or "evidence")
            side[role] = side.get(role, 0) + 1
    lines = [f"- Experiments: {len(kinds)}; " + ", ".join(f"{int(n)} {k}" for k, n in by_kind.items()) + "."]
    for side, roles in checks.items():
        lines.append(f"- Checks of {side}: {roles.get('evidence', 0)} evidence, {roles.get('context', 0)} context.")
    return lines


def _fraction(text: str) -> tuple:
    done, _, total = str(text).partition("/")
    return int(done), int(total or 0)


def exceptions_sentences(margins: pd.DataFrame) -> List[str]:
    """Each evidence check that did not hold on every seed of its failure, or held on a seed of
    its control, and each check its control could not answer, as one sentence."""
    lines = []
    for row in margins.to_dict("records"):
        if row["role"] != "evidence":
            continue
        held, n = _fraction(row["holds_on_failure"])
        failed, answered = _fraction(row["fails_on_control"])
        where = f"`{row['experiment']}` check {row['check']} ({row['claim_kind']})"
        if held < n:
            lines.append(f"- {where}: held on the failure on {held} of {n} seeds.")
        if failed < answered:
            lines.append(f"- {where}: held on the control `{row['control']}` on {answered - failed} of {answered} "
                         "seeds.")
        if row["control_n/a"]:
            lines.append(f"- {where}: the control could not answer it on {row['control_n/a']} seeds (n/a).")
    return lines or ["- None: every evidence check held on its failure and failed on its control on every seed."]


def evidence_section(runs: Sequence[Run], tables: Dict[str, pd.DataFrame], source: str) -> List[str]:
    """The section's markdown lines."""
    margins = tables.get("margins", pd.DataFrame())
    lines = [
        "## What the verdicts prove", "", MARKER.format(hash=source), "",
        "An **empirical** claim (a paper's measured result) is REPRODUCED when every evidence check held: "
        "each is a measurement that could have come out either way. A **mechanism** (a documented "
        "behaviour of PyTorch, of a bug or of a derivation) is DEMONSTRATED by its symptom in the records "
        "and the detector that names it: no run of it could have refuted anything. An **observation** of "
        "ours (a measurement no paper published and no documentation states) is OBSERVED when every "
        "evidence check held: a measurement that could have come out either way, with nothing published "
        "behind it. A check that reads a config knob back is context.", "",
        *counts_sentences(runs), "",
        "### Each failure's checks against its control, over the seeds", "",
        "Every check of a failure's signature on the failure and on its control (the control answers with "
        "reference runs it made itself; one of its own experiment is a replicate with another seed; nothing "
        "is lent). `holds_on_failure`: seeds where the check held on the failure; `fails_on_control`: seeds "
        "where it failed on the control, of those the control could answer (`control_n/a` counts the rest, "
        "never as a failure). Margins: how far the observed value is on the holding side of the threshold on "
        "the failure, and on the failing side on the control (negative: the wrong side), the smallest over "
        "the seeds with its seed.", "",
        "Evidence checks that did not flip on every seed:", "",
        *(exceptions_sentences(margins) if not margins.empty else ["- No failure and control pair was read."]), "",
    ]
    if not margins.empty:
        shown = margins[[c for c in SHOWN if c in margins.columns]]
        lines += [markdown(shown, floatfmt=".4g", missingval=""), ""]
    return lines
