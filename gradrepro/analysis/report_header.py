"""The sentences of the report that describe its runs, each computed from the runs it read
(their summaries and overrides), never from the report's own defaults: a report written from
an existing sweep says what that sweep holds, not what a fresh one would have run."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import pandas as pd

from gradrepro.records.reader import Run
from gradrepro.signature import verdict_word


def _seed_sentence(runs_df: pd.DataFrame) -> str:
    """How many seeds each experiment has, from the runs' own ``seed``."""
    per_experiment: Dict[str, List[object]] = {
        str(name): sorted({s for s in group["seed"] if s is not None and s == s}, key=str)
        for name, group in runs_df.groupby("experiment", sort=True)
    }
    counts = sorted({len(seeds) for seeds in per_experiment.values()})
    if counts == [0]:
        return "no run recorded a seed"
    shared = {tuple(map(str, seeds)) for seeds in per_experiment.values()}
    if len(shared) == 1:
        seeds = next(iter(shared))
        return f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} per experiment ({', '.join(seeds)})"
    return f"{counts[0]} to {counts[-1]} seeds per experiment"


def runs_sentence(runs: Sequence[Run], runs_df: pd.DataFrame) -> str:
    """``N experiments, M runs, 3 seeds per experiment (0, 1, 2)``; recordings said as such."""
    n_exp = runs_df["experiment"].nunique()
    recorded = sum(1 for run in runs if run.summary.get("recorded_by"))
    said = f"{n_exp} experiment{'s' if n_exp != 1 else ''}, {len(runs)} run{'s' if len(runs) != 1 else ''}"
    if recorded:
        said += f" ({recorded} recorded in a user's own loop by gradrepro.record)"
    return f"{said}, {_seed_sentence(runs_df)}"


def scale_of(runs: Sequence[Run]) -> Optional[str]:
    """The ``scale`` every run was made at, where they agree (None: the default, or mixed)."""
    scales = {run.overrides.get("scale") for run in runs}
    return next(iter(scales)) if len(scales) == 1 else None


def control_sentence(name: str, runs: Sequence[Run]) -> str:
    """What the experiment is compared with, from the runs read."""
    own = next(r for r in runs if r.experiment == name)
    if own.summary.get("recorded_by"):
        return "A recording of a user's own training loop: no control, no signature."
    if own.control:
        return f"Control: `{own.control}`."
    ablations = sorted({r.experiment for r in runs if r.control == name})
    if ablations:
        return f"The control of {', '.join(f'`{a}`' for a in ablations)}."
    return "No control."


def held_words(kind: Optional[str], held: int, n: int, seeds: Sequence[str]) -> str:
    """What the signature did here, said beside the claim: ``Here: REPRODUCED on 1 of 2 seeds
    (100, 101); not reproduced on the other 1.``"""
    word, not_word = verdict_word(True, kind), verdict_word(False, kind)
    on = f"({', '.join(map(str, seeds))})" if seeds else "(seeds not recorded)"
    if n == 0:
        return "Here: no run completed."
    if held == n:
        return f"Here: {word} on all {n} seeds {on}."
    if held == 0:
        return f"Here: {not_word} on any of the {n} seeds {on}."
    return f"Here: {word} on {held} of {n} seeds {on}; {not_word} on the other {n - held}."


def here_sentence(name: str, runs: Sequence[Run], runs_df: pd.DataFrame) -> str:
    """``held_words`` for one experiment, from its completed runs."""
    own = next(r for r in runs if r.experiment == name)
    if own.summary.get("recorded_by"):
        return ""
    group = runs_df[runs_df["experiment"] == name]
    done = group[group["complete"].astype(bool)]
    seeds = sorted({str(s) for s in done["seed"] if s is not None and s == s}, key=lambda s: (len(s), s))
    return held_words(own.summary.get("claim_kind"), int(done["reproduced"].astype(bool).sum()), len(done), seeds)


def claim_sentence(run: Run) -> str:
    claim = str(run.summary.get("claim") or "").strip()
    return f"{claim.rstrip('.')}." if claim else "No claim recorded."


def commits_sentence(runs: Sequence[Run]) -> str:
    """Which commits of gradrepro made the runs, from their recorded versions."""
    commits = sorted({str((run.summary.get("versions") or {}).get("git_commit") or "unknown") for run in runs})
    short = [c[:10] for c in commits]
    if len(commits) == 1:
        return f"Made at commit {short[0]}." if commits[0] != "unknown" else "The commit is not recorded."
    return f"Made at {len(commits)} commits ({', '.join(short)}): not one commit."
