"""Which software made each run: runs of different gradrepro, torch or Python versions put side
by side differ in more than their knob (a changed kernel, a changed default), so the runs table
shows a column per version that differs, and a warning names each ablation/control pair whose
runs straddle versions."""

from __future__ import annotations

from typing import Dict, List, Sequence

import pandas as pd

from gradrepro.records.reader import Run

SOFTWARE = ("gradrepro", "torch", "python")


def run_versions(run: Run) -> Dict[str, str]:
    """``{software: version}`` as the run's summary.json recorded them ("?" where it did not)."""
    recorded = run.summary.get("versions")
    recorded = recorded if isinstance(recorded, dict) else {}
    return {name: str(recorded.get(name)) if recorded.get(name) is not None else "?" for name in SOFTWARE}


def differing_software(runs: Sequence[Run]) -> List[str]:
    """The software whose version is not the same in every run."""
    found = [run_versions(run) for run in runs]
    return [name for name in SOFTWARE if len({v[name] for v in found}) > 1]


def version_columns(runs: Sequence[Run]) -> Dict[str, List[str]]:
    """``{"torch version": [...per run...]}`` for each software that differs between the runs."""
    found = [run_versions(run) for run in runs]
    return {f"{name} version": [v[name] for v in found] for name in differing_software(runs)}


def version_warnings(runs: Sequence[Run], runs_df: pd.DataFrame) -> List[str]:
    """One warning per ablation whose runs and its control's runs come from different versions."""
    differing = differing_software(runs)
    if not differing:
        return []
    versions = [run_versions(run) for run in runs]
    warnings = []
    for experiment, group in runs_df.groupby("experiment", sort=True):
        control = group["control"].iloc[0]
        if not isinstance(control, str):
            continue
        pair = list(group.index) + list(runs_df.index[runs_df["experiment"] == control])
        if len(pair) == len(group):
            continue  # its control is not among the runs
        spans = {name: sorted({versions[i][name] for i in pair}) for name in differing}
        spans = {name: vs for name, vs in spans.items() if len(vs) > 1}
        if spans:
            said = "; ".join(f"{name} {', '.join(vs)}" for name, vs in spans.items())
            warnings.append(f"{experiment} and its control {control} come from different versions ({said}): "
                            "a difference between them may come from the software, not the knob")
    return warnings
