"""``compare --plot``: the compared runs' loss curves on one axis, beside a per-module panel
of one signal metric (default: gradient norm), one line per run.

Runs of one group (experiment and differing overrides) share a colour; seeds differ by line
style. The legend sits below both panels, so it never covers a curve.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional, Sequence

import matplotlib
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from matplotlib.figure import Figure

from gradrepro.analysis.tables import differing_knobs
from gradrepro.records.files import MODULES, write_output
from gradrepro.records.reader import TEXT_COLUMNS, Run
from gradrepro.records.untrusted import one_line, open_regular

# Norms combine over a module's tensors as an L2 norm; every other column as a mean.
_L2_COLUMNS = {"grad_norm", "param_norm"}
_STYLES = ("-", "--", ":", "-.")


def module_values(modules: pd.DataFrame, metric: str) -> pd.Series:
    """One value per module (network order): per step, the module's tensors combined; then
    the median over logged steps."""
    df = modules[["step", "module", metric]].copy()
    if metric in _L2_COLUMNS:
        df[metric] = df[metric] ** 2
        per_step = np.sqrt(df.groupby(["module", "step"], sort=False)[metric].sum(min_count=1))
    else:
        per_step = df.groupby(["module", "step"], sort=False)[metric].mean()
    per_step = per_step.replace([np.inf, -np.inf], np.nan)
    return per_step.groupby(level="module", sort=False).median()


def metric_columns(runs: Sequence[Run]) -> List[str]:
    """The per-module metrics the runs recorded: the numeric columns of their modules.parquet
    (schema only; a run whose file cannot be read adds none)."""
    found: dict = {}
    for run in runs:
        try:
            with open_regular(run.path / MODULES) as f:
                names = pq.ParquetFile(f).schema_arrow.names
        except Exception:  # noqa: BLE001 - a run folder is data: an unreadable one adds nothing
            continue
        found.update(dict.fromkeys(n for n in names if n not in ("step", *TEXT_COLUMNS[MODULES])))
    return list(found)


def _group_label(run: Run, knobs: Sequence[str]) -> str:
    extra = ",".join(f"{k}={run.overrides[k]}" for k in knobs if k in run.overrides)
    return run.experiment + (f" [{extra}]" if extra else "")


def figure_runs(
    runs: Sequence[Run], metric: str = "grad_norm", warnings: Optional[List[str]] = None
):
    """The matplotlib Figure (not saved): axes[0] loss curves, axes[1] the per-module panel.
    Built without pyplot, so it leaves the caller's matplotlib backend and figures alone."""
    knobs = differing_knobs(runs)
    groups = list(dict.fromkeys(_group_label(r, knobs) for r in runs))
    colors = matplotlib.colormaps["tab10" if len(groups) <= 10 else "tab20"]
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    ax_loss, ax_mod = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    module_order: List[str] = []
    per_run = []
    seen_in_group: dict = {}
    for run in runs:
        group = _group_label(run, knobs)
        style = _STYLES[seen_in_group.get(group, 0) % len(_STYLES)]
        seen_in_group[group] = seen_in_group.get(group, 0) + 1
        color = colors(groups.index(group) % colors.N)
        label = f"{group} seed={run.summary.get('seed')}" + (
            "" if run.complete else " (incomplete)"
        )
        try:
            scalars = run.scalars()
            loss = scalars.dropna(subset=["loss"])
            values = module_values(run.modules(["step", "module", metric]), metric)
        except Exception as exc:  # noqa: BLE001 - a run folder is data: a bad one is left out
            if warnings is not None:
                warnings.append(f"{one_line(run.path)}: not drawn ({type(exc).__name__}: {one_line(exc, 200)})")
            continue
        ax_loss.plot(loss["step"], loss["loss"], color=color, linestyle=style, label=label)
        module_order += [m for m in values.index if m not in module_order]
        per_run.append((values, color, style, label))
    for values, color, style, label in per_run:
        aligned = values.reindex(module_order)
        ax_mod.plot(
            range(len(module_order)),
            aligned.to_numpy(dtype=float),
            color=color,
            linestyle=style,
            marker=".",
            label=label,
        )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_mod.set_xticks(range(len(module_order)), module_order, rotation=45, ha="right", fontsize=7)
    ax_mod.set_ylabel(metric)
    ax_mod.set_title(f"{metric} per module (median over logged steps; gaps: none or non-finite)")
    finite = [v.to_numpy(dtype=float) for v, *_ in per_run]
    finite = np.concatenate(finite) if finite else np.array([])
    finite = finite[np.isfinite(finite)]
    if finite.size and (finite > 0).all():
        ax_mod.set_yscale("log")
    if per_run:
        fig.legend(
            *ax_loss.get_legend_handles_labels(),
            loc="outside lower center",
            ncol=max(1, min(3, math.ceil(len(per_run) / 4))),
            fontsize=8,
            frameon=False,
        )
    return fig


def plot_runs(
    runs: Sequence[Run], path: Path, metric: str = "grad_norm", warnings: Optional[List[str]] = None
) -> int:
    """Draw :func:`figure_runs` to ``path`` (atomically); returns the number of runs drawn."""
    fig = figure_runs(runs, metric, warnings)
    drawn = len(fig.axes[0].get_lines())
    write_output(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "the figure")
    return drawn
