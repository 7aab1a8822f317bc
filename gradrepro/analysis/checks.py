"""The checks table: every check of every failure's signature, on the failure's records and on
its control's, seed by seed, and the margins table that summarises it over seeds.

A failure experiment's check is **evidence** when it holds on the failure and fails on the
control (``ok_failure`` true, ``ok_control`` false); a **context** check is shown and never
decides. The control answers with its own records and the reference runs it made itself
(a control declares the references its failures' checks name; one of its own experiment is a
replicate with another seed): nothing is lent, since a ratio of the control to a copy of itself
reads 1 whatever happened. A check the control's records cannot answer (nothing recorded, a
reference it did not make) reads n/a: ``ok_control`` is empty, never counted as a failure, and
``note`` says why.

``signatures="current"`` evaluates the signatures of the package's configs (composed with each
run's overrides) instead of the ones the runs recorded: new checks on runs recorded before.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
from omegaconf import OmegaConf

from gradrepro.config.compose import compose
from gradrepro.records.reader import Run, signature_of
from gradrepro.signature import evaluate

SIGNATURE_SOURCES = ("recorded", "current")
CHECK_COLUMNS = ("experiment", "control", "claim_kind", "seed", "check", "role", "op", "threshold", "ok_failure",
                 "ok_control", "observed_failure", "observed_control", "margin_failure", "margin_control", "note")


def margin(observed: float, op: str, threshold: float) -> float:
    """How far ``observed`` is on the holding side of ``op threshold`` (negative: the failing
    side); NaN when nothing was observed."""
    if observed is None or math.isnan(observed):
        return math.nan
    return observed - threshold if op in (">=", ">") else threshold - observed


def current_signature(run: Run, cache: Dict[Tuple[str, ...], Any]) -> Optional[Dict[str, Any]]:
    """The signature the package's configs give this run's overrides (the seed left out: no
    signature depends on it). None when they no longer compose (an experiment renamed), or
    when an override holds an interpolation (a folder's text is never evaluated)."""
    overrides = tuple(sorted(str(o) for o in run.summary.get("overrides") or []
                             if not str(o).startswith(("seed=", "hydra.", "hydra/"))))
    if any("${" in o for o in overrides):
        return None
    if overrides not in cache:
        try:
            cfg = compose(list(overrides))
            cache[overrides] = OmegaConf.to_container(cfg.signature, resolve=True)
        except Exception:  # noqa: BLE001 - a config that no longer composes: no signature
            cache[overrides] = None
    return cache[overrides]


def _seed(run: Run) -> Any:
    seed = run.summary.get("seed")
    return int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else seed


def _same_knobs(a: Run, b: Run, knobs: Sequence[str]) -> bool:
    return all(a.overrides.get(k) == b.overrides.get(k) for k in knobs)


def pair_runs(runs: Sequence[Run], knobs: Sequence[str]) -> List[Tuple[Run, Optional[Run]]]:
    """Each complete run that names a control, with the control's complete run of the same seed
    and the same other knobs (None when it is not among ``runs``)."""
    done = [r for r in runs if r.complete]
    pairs = []
    for run in done:
        if not isinstance(run.control, str):
            continue
        match = [c for c in done if c.experiment == run.control and _seed(c) == _seed(run)
                 and _same_knobs(c, run, knobs)]
        pairs.append((run, match[0] if match else None))
    return pairs


def checks_table(runs: Sequence[Run], knobs: Sequence[str] = (), signatures: str = "recorded",
                 warnings: Optional[List[str]] = None) -> pd.DataFrame:
    """One row per (failure run, check): see the module's docstring."""
    if signatures not in SIGNATURE_SOURCES:
        raise ValueError(f"signatures={signatures!r}: choose {' or '.join(SIGNATURE_SOURCES)}")
    cache: Dict[Tuple[str, ...], Any] = {}
    rows = []
    for failure, control in pair_runs(runs, knobs):
        signature = current_signature(failure, cache) if signatures == "current" else signature_of(failure)
        if not signature or not signature.get("checks"):
            _warn(warnings, f"{failure.path}: no signature to evaluate ({signatures})")
            continue
        try:
            failure_records = failure.records()
            mine = evaluate(signature, failure_records).checks
        except Exception as exc:  # noqa: BLE001 - unreadable records: the run is left out
            _warn(warnings, f"{failure.path}: records unreadable ({type(exc).__name__}); left out")
            continue
        theirs, note = [None] * len(mine), ""
        if control is None:
            note = f"no {failure.control} run of this seed"
        else:
            try:
                theirs = evaluate(signature, control.records()).checks  # its own references only
            except Exception as exc:  # noqa: BLE001
                note = f"control records unreadable ({type(exc).__name__})"
        knob_values = {k: failure.overrides.get(k) for k in knobs}
        for i, (check, other) in enumerate(zip(mine, theirs)):
            observed_control = other.observed if other is not None else math.nan
            rows.append({
                "experiment": failure.experiment, "control": failure.control,
                "claim_kind": failure.summary.get("claim_kind"), **knob_values,
                "seed": _seed(failure), "check": f"{i}: {check.quantity}", "role": check.role,
                "op": check.op, "threshold": check.threshold, "ok_failure": check.ok,
                "ok_control": None if math.isnan(observed_control) else other.ok,
                "observed_failure": check.observed, "observed_control": observed_control,
                "margin_failure": margin(check.observed, check.op, check.threshold),
                "margin_control": -margin(observed_control, check.op, check.threshold),
                "note": note or (other.note if other is not None and math.isnan(observed_control) else ""),
            })
    columns = [*CHECK_COLUMNS[:3], *knobs, *CHECK_COLUMNS[3:]]
    return pd.DataFrame(rows, columns=columns)


def margins_table(checks: pd.DataFrame) -> pd.DataFrame:
    """Per (experiment, check) over seeds: on how many the check held on the failure and failed
    on the control (n/a seeds counted apart), and the smallest margin on each side with its
    seed (margin on the control: how far it is on the failing side)."""
    if checks.empty:
        return pd.DataFrame()
    own = ("experiment", "control", "claim_kind", "check")
    keys = [c for c in checks.columns if c not in CHECK_COLUMNS or c in own]
    rows = []
    for key, group in checks.groupby([*keys, "role", "op", "threshold"], sort=False, dropna=False):
        answered = group["ok_control"].dropna()
        rows.append({
            **dict(zip([*keys, "role", "op", "threshold"], key)),
            "seeds": " ".join(str(s) for s in sorted(group["seed"])),
            "holds_on_failure": f"{int(group['ok_failure'].sum())}/{len(group)}",
            "fails_on_control": f"{int((~answered.astype(bool)).sum())}/{len(answered)}",
            "control_n/a": int(len(group) - len(answered)),
            **_smallest(group, "failure"),
            **_smallest(group, "control"),
        })
    return pd.DataFrame(rows)


def _smallest(group: pd.DataFrame, side: str) -> Dict[str, Any]:
    """The smallest margin on one side over the group's seeds, and the seed it was on."""
    values = group[f"margin_{side}"].dropna()
    if values.empty:
        return {f"min_margin_{side}": math.nan, f"at_seed_{side}": None}
    at = values.idxmin()
    return {f"min_margin_{side}": float(values[at]), f"at_seed_{side}": group.at[at, "seed"]}


def _warn(warnings: Optional[List[str]], line: str) -> None:
    if warnings is not None:
        warnings.append(line)
