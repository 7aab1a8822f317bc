"""The comparison tables of many runs, as pandas DataFrames, and their rendering.

- **runs**: one row per run: experiment, control, the overrides that differ between the runs,
  seed, status, ``reproduced``, each signature check's observed value, threshold and the
  paper's reference beside it, final loss, steps, wall time;
- **groups**: grouped by the scientific knob (default: the experiment and the overrides that
  differ, other than the seed; tuning_playbook's scientific vs nuisance knobs), mean and std
  over seeds and how many seeds reproduced the signature;
- **pairs**: each ablation beside its control when both are present: the ablation's own
  signature evaluated on the control's records too, so every column is comparable;
- **checks** and **margins**: every check of an ablation's signature on it and on its control,
  seed by seed, and over seeds (``analysis/checks.py``).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pandas as pd

from gradrepro.analysis.checks import checks_table, current_signature, margins_table
from gradrepro.analysis.fit_width import WIDTH, markdown, markdown_within
from gradrepro.analysis.versions import version_columns, version_warnings
from gradrepro.records.reader import Run, signature_of
from gradrepro.signature import evaluate
from gradrepro.signature import quantity as signature_quantity

TABLES = ("runs", "groups", "pairs", "checks", "margins")
_TAIL = ("final_loss", "steps", "wall_s")


def quantity(check: Dict[str, Any]) -> str:
    """What a check measures, as a column name (``signature.quantity``: ``knn_acc gain`` is a
    gain, not an accuracy), so that one column holds one quantity across runs."""
    params = check.get("params")
    return signature_quantity(str(check.get("metric")), params if isinstance(params, dict) else {})


def check_keys(checks: Sequence[Dict[str, Any]]) -> List[str]:
    """Column names for a signature's checks: its quantity (``quantity``), ``...#2`` for a
    second check of the same quantity."""
    keys, seen = [], {}
    for check in checks:
        metric = quantity(check)
        seen[metric] = seen.get(metric, 0) + 1
        keys.append(metric if seen[metric] == 1 else f"{metric}#{seen[metric]}")
    return keys


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def differing_knobs(runs: Sequence[Run]) -> List[str]:
    """Override keys whose value is not the same in every run (seed and experiment aside)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.overrides))
    return [
        k
        for k in keys
        if k not in ("seed", "experiment") and len({run.overrides.get(k) for run in runs}) > 1
    ]


def _labels(runs: Sequence[Run]) -> List[str]:
    if len(runs) == 1:
        return [runs[0].path.name]
    root = Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
    return [str(r.path.resolve().relative_to(root)) or r.path.name for r in runs]


def runs_table(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run."""
    knobs = differing_knobs(runs)
    rows, check_cols = [], []
    for run, label in zip(runs, _labels(runs)):
        s = run.summary
        row = {
            "run": label,
            "experiment": run.experiment,
            "control": run.control,
            "claim_kind": s.get("claim_kind"),
            **{k: run.overrides.get(k) for k in knobs},
            "seed": s.get("seed"),
            "status": run.status,
            "complete": run.complete,
            "reproduced": s.get("reproduced") if run.complete else None,
        }
        checks = s.get("checks") or []
        for key, check in zip(check_keys(checks), checks):
            row[key] = _float(check.get("observed"))
            row[f"{key} thr"] = f"{check.get('op')} {_float(check.get('threshold')):.4g}"
            row[f"{key} paper"] = check.get("paper")
            check_cols += [c for c in (key, f"{key} thr", f"{key} paper") if c not in check_cols]
        row.update(final_loss=run.final_loss, steps=s.get("steps"), wall_s=_float(s.get("wall_s")))
        rows.append(row)
    software = version_columns(runs)  # only the versions that differ between the runs
    for i, row in enumerate(rows):
        row.update({name: values[i] for name, values in software.items()})
    head = ["run", "experiment", "control", "claim_kind", *knobs, "seed", "status", "complete", "reproduced"]
    df = pd.DataFrame(rows).reindex(columns=head + check_cols + list(_TAIL) + list(software))
    for knob in knobs:  # override values are text: numbers compare and sort as numbers
        try:
            df[knob] = pd.to_numeric(df[knob])
        except (ValueError, TypeError):
            pass
    df.attrs["knobs"] = knobs
    df.attrs["checks"] = [c for c in check_cols if not c.endswith((" thr", " paper"))]
    return df


def _mean_std(
    frame: pd.DataFrame, groups: Any, cols: Sequence[str], suffix: str = ""
) -> pd.DataFrame:
    stats = frame.groupby(groups, dropna=False, sort=False)[list(cols)].agg(["mean", "std"])
    stats.columns = [f"{col}{suffix} {stat}" for col, stat in stats.columns]
    return stats


def groups_table(runs_df: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Mean, std and n over the runs of each value of ``by`` (complete runs only)."""
    by = list(by)
    done = runs_df[runs_df["complete"]].astype({"reproduced": bool})
    checks = runs_df.attrs.get("checks", [])
    grouped = done.groupby(by, dropna=False, sort=False)
    n = grouped.size().rename("n")
    text_cols = ["control", "claim_kind"] + [c for col in checks for c in (f"{col} thr", f"{col} paper")]
    first = grouped[[c for c in text_cols if c not in by]].first()
    reproduced = grouped["reproduced"].sum().astype(int).astype(str) + "/" + n.astype(str)
    incomplete = runs_df[~runs_df["complete"]].groupby(by, dropna=False, sort=False).size()
    stats = _mean_std(done, by, [*checks, *_TAIL])
    out = pd.concat(
        [n, reproduced.rename("reproduced"), incomplete.rename("incomplete"), first, stats], axis=1
    )
    out["incomplete"] = out["incomplete"].fillna(0).astype(int)
    out["n"] = out["n"].fillna(0).astype(int)
    order = ["n", "reproduced", "incomplete", "control", "claim_kind"]
    for col in [*checks, *_TAIL]:
        order += [
            c for c in (f"{col} mean", f"{col} std", f"{col} thr", f"{col} paper") if c in out
        ]
    return out[[c for c in order if c in out]].reset_index()


def _observe(signature: Dict[str, Any], run: Run) -> Dict[str, Any]:
    """The ``signature`` evaluated on ``run``'s records: ``{key: observed, "reproduced": bool}``."""
    verdict = evaluate(signature, run.records())  # its reference runs included
    keys = check_keys(signature.get("checks") or [])
    return {
        "reproduced": verdict.reproduced,
        **{k: c.observed for k, c in zip(keys, verdict.checks)},
    }


def pairs_table(
    runs: Sequence[Run], runs_df: pd.DataFrame, warnings: Optional[List[str]] = None,
    signatures: str = "recorded",
) -> pd.DataFrame:
    """Each ablation beside its control (same other knobs), both measured by its own checks
    (the ones it recorded, or with ``signatures="current"`` the package's)."""
    cache: Dict[Any, Any] = {}
    knobs = list(runs_df.attrs.get("knobs", []))
    done = runs_df[runs_df["complete"]]
    by_index = {i: run for i, run in enumerate(runs)}
    rows = []
    for key, group in done.groupby(["experiment", *knobs], dropna=False, sort=False):
        control = group["control"].iloc[0]
        if not isinstance(control, str):
            continue
        same = done["experiment"] == control
        for knob in knobs:
            value = group[knob].iloc[0]
            same &= done[knob].isna() if value is None or value != value else done[knob] == value
        controls = done[same]
        if controls.empty:
            continue
        first = by_index[group.index[0]]
        signature = current_signature(first, cache) if signatures == "current" else signature_of(first)
        if signature is None:
            if warnings is not None:
                warnings.append(
                    f"{by_index[group.index[0]].path}: no readable .hydra/config.yaml: "
                    f"cannot evaluate its signature on {control}"
                )
            continue
        keys = check_keys(signature.get("checks") or [])
        observed = []
        for i in controls.index:
            try:
                observed.append(_observe(signature, by_index[i]))
            except Exception as exc:  # unreadable records: leave this control run out
                if warnings is not None:
                    warnings.append(
                        f"{by_index[i].path}: records unreadable ({type(exc).__name__}); "
                        "left out of the pair table"
                    )
        if not observed:
            continue
        ctrl = pd.DataFrame(observed).reindex(columns=["reproduced", *keys])
        ctrl["final_loss"] = controls["final_loss"].to_numpy()[: len(ctrl)]
        row = dict(zip(["experiment", *knobs], key if isinstance(key, tuple) else (key,)))
        row.update(
            control=control,
            claim_kind=group["claim_kind"].iloc[0],
            n=len(group),
            reproduced=f"{int(group['reproduced'].astype(bool).sum())}/{len(group)}",
            **{
                "control n": len(ctrl),
                "control reproduced": f"{int(ctrl['reproduced'].astype(bool).sum())}/{len(ctrl)}",
            },
        )
        for col in [*keys, "final_loss"]:
            mine = group[col] if col in group else pd.Series(dtype=float)
            row[f"{col} mean"], row[f"{col} std"] = mine.mean(), mine.std()
            row[f"{col} control mean"], row[f"{col} control std"] = (
                ctrl[col].mean(),
                ctrl[col].std(),
            )
            if f"{col} thr" in group:
                row[f"{col} thr"] = group[f"{col} thr"].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


def build_tables(
    runs: Sequence[Run], by: Optional[Sequence[str]] = None, warnings: Optional[List[str]] = None,
    signatures: str = "recorded",
) -> Dict[str, pd.DataFrame]:
    """``{"runs": ..., "groups": ..., "pairs": ..., "checks": ..., "margins": ...}`` (``by``
    defaults to the knobs; ``signatures``: the runs' recorded ones or the package's current)."""
    runs_df = runs_table(runs)
    if warnings is not None:
        warnings.extend(version_warnings(runs, runs_df))
    by = list(by) if by else ["experiment", *runs_df.attrs["knobs"]]
    unknown = [k for k in by if k not in runs_df.columns]
    if unknown:
        raise KeyError(
            f"--by {' '.join(unknown)}: no such column; "
            f"choose from: {', '.join(map(str, runs_df.columns))}"
        )
    groups = groups_table(runs_df, by)
    groups.attrs["by"] = by
    checks = checks_table(runs, runs_df.attrs["knobs"], signatures, warnings)
    return {"runs": runs_df, "groups": groups, "pairs": pairs_table(runs, runs_df, warnings, signatures),
            "checks": checks, "margins": margins_table(checks)}


# --- rendering: pandas writes every format --------------------------------------------------


def _fmt(value: Any) -> str:
    return (
        ""
        if value is None or (isinstance(value, float) and not np.isfinite(value))
        else f"{value:.4g}"
    )


def for_reading(df: pd.DataFrame) -> pd.DataFrame:
    """Join ``X mean``/``X std`` into one ``X`` column, ``mean ± std`` (std only if n > 1)."""
    df = df.copy()
    for col in [c for c in df.columns if str(c).endswith(" mean")]:
        base, std = col[: -len(" mean")], col[: -len(" mean")] + " std"
        text = df[col].map(_fmt)
        if std in df:
            spread = df[std].map(_fmt)
            text = text.where(spread == "", text + " ± " + spread)
            df = df.drop(columns=std)
        df[col] = text
        df = df.rename(columns={col: base})
    for col in df.columns:  # blanks, not "nan", for what a run did not record
        if pd.api.types.is_float_dtype(df[col]):
            df[col] = df[col].map(_fmt)
        elif not pd.api.types.is_numeric_dtype(df[col]):
            df[col] = df[col].astype(object).where(df[col].notna(), "")
    return df


TITLES = {
    "runs": "Runs",
    "groups": "Groups (mean ± std over seeds; reproduced = seeds whose signature held: REPRODUCED for an "
    "empirical claim, DEMONSTRATED for a mechanism, OBSERVED for an observation of ours)",
    "pairs": "Ablation vs control (the ablation's checks evaluated on both; "
    "control reproduced should be 0/n)",
    "checks": "Checks (each ablation's checks on it and on its control, per seed, the control with its own "
    "reference runs; evidence: ok_failure true and ok_control false; n/a: the control cannot answer)",
    "margins": "Margins over seeds (min margin on the control: how far it is on the failing side)",
}


def _markdown_title(title: str, width: Optional[int]) -> str:
    """``## Name`` and, below it, the explanation in brackets, wrapped to ``width``."""
    name, _, said = title.partition(" (")
    if not said or width is None:
        return f"## {title}\n"
    return f"## {name}\n\n" + textwrap.fill(said.rstrip(")"), width) + "\n"


def render(
    tables: Dict[str, pd.DataFrame], fmt: str = "markdown", which: Sequence[str] = TABLES,
    width: Optional[int] = WIDTH,
) -> str:
    """The chosen tables in ``fmt``; with several tables, one titled section each. CSV holds
    one table (a file of several would be no CSV file): ValueError if asked for more.
    Markdown fits ``width`` columns (``fit_width``); ``width=None``: each table in one piece."""
    chosen = {k: tables[k] for k in which if k in tables and not tables[k].empty}
    if fmt == "json":
        return json.dumps(
            {k: json.loads(df.to_json(orient="records")) for k, df in chosen.items()}, indent=2
        )
    if fmt == "csv":
        if len(chosen) > 1:
            raise ValueError(f"csv holds one table; asked for {', '.join(chosen)}")
        return "".join(df.to_csv(index=False) for df in chosen.values())
    parts = []
    for name, df in chosen.items():
        if fmt == "latex":
            body = for_reading(df).to_latex(index=False, na_rep="", escape=True)
        elif width is not None:
            body = markdown_within(for_reading(df), width)
        else:
            body = markdown(for_reading(df), floatfmt=".4g", missingval="")
        if len(chosen) > 1:
            title = (
                TITLES[name]
                if name != "groups"
                else (
                    TITLES[name].replace("Groups", f"Groups by {', '.join(df.attrs.get('by', []))}")
                )
            )
            head = {"markdown": _markdown_title(title, width), "latex": f"% {title}"}[fmt]
            body = f"{head}\n{body}"
        parts.append(body.rstrip("\n"))
    return "\n\n".join(parts) + "\n"
