"""signals.png: the loss curve (and the key scalar) next to a per-module heat map of
gradient norm over steps: a falling loss beside the modules that actually got signal; then
every other logged scalar the signature's checks read (SimSiam's k-NN accuracy, the training
accuracy a speedup counts steps to), with the threshold where a check compares it directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradrepro.records.files import atomic_write

FONT_SIZE = 8  # one size for every text of the figure: titles, labels, ticks, threshold labels
_ONE_SIZE = {key: FONT_SIZE for key in ("font.size", "axes.titlesize", "axes.labelsize", "xtick.labelsize",
                                        "ytick.labelsize", "legend.fontsize", "figure.titlesize")}


def module_grad_norms(modules: pd.DataFrame) -> pd.DataFrame:
    """module x step table of each module's gradient norm (its tensors combined, L2)."""
    df = modules[["step", "module", "grad_norm"]].copy()
    df["sq"] = df["grad_norm"] ** 2
    table = df.pivot_table(index="module", columns="step", values="sq", aggfunc="sum", dropna=False)
    order = list(dict.fromkeys(modules["module"]))  # network order, not alphabetical
    return np.sqrt(table.reindex([m for m in order if m in table.index]))


def checked_scalars(checks: Sequence[Dict[str, Any]], columns: Sequence[str]) -> Dict[str, List[float]]:
    """The logged scalars (other than the loss) that ``checks`` read, each with the thresholds
    of the checks that compare it directly (the column reduced, nothing derived from it)."""
    shown: Dict[str, List[float]] = {}
    for check in checks:
        params = dict(check.get("params") or {})
        for name in (check.get("metric"), params.get("column"), params.get("numerator"), params.get("denominator")):
            if isinstance(name, str) and name in columns and name != "loss":
                shown.setdefault(name, [])
        direct = check.get("metric") in columns and not {"relative_to", "transform", "scale"} & set(params)
        if direct and check.get("metric") != "loss" and params.get("reduce") != "change":
            shown[check["metric"]].append(float(check["threshold"]))
    return shown


def plot_signals(
    scalars: pd.DataFrame,
    modules: pd.DataFrame,
    path: Path,
    title: str,
    key_scalar: Optional[str] = None,
    checked: Optional[Dict[str, List[float]]] = None,
) -> None:
    """The figure; ``checked``: the scalars the signature reads, with their thresholds
    (``checked_scalars``), each in its own small panel."""
    fig = signals_figure(scalars, modules, title, key_scalar, checked)
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def signals_figure(scalars: pd.DataFrame, modules: pd.DataFrame, title: str, key_scalar: Optional[str] = None,
                   checked: Optional[Dict[str, List[float]]] = None) -> Figure:
    """``plot_signals``'s figure, not saved: every text in one font size."""
    with matplotlib.rc_context(_ONE_SIZE):
        return _signals_figure(scalars, modules, title, key_scalar, checked)


def _signals_figure(scalars: pd.DataFrame, modules: pd.DataFrame, title: str, key_scalar: Optional[str],
                    checked: Optional[Dict[str, List[float]]]) -> Figure:
    key_thresholds = (checked or {}).get(key_scalar, []) if key_scalar else []  # drawn on the loss panel
    checked = {k: v for k, v in (checked or {}).items() if k in scalars and k != key_scalar}
    fig = Figure(figsize=(13 + 3 * bool(checked), 5))  # no pyplot: the caller's backend stays as it is
    moving = scale_moves(scalars)
    ratios = [1, 1.4] + [0.8] * moving + [0.8] * bool(checked)
    grid = fig.add_gridspec(1, len(ratios), width_ratios=ratios)
    ax_loss, ax_heat = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    if moving:
        plot_loss_scale(fig.add_subplot(grid[0, 2]), scalars)
    if checked:
        cells = grid[0, len(ratios) - 1].subgridspec(len(checked), 1)
        for i, (name, thresholds) in enumerate(checked.items()):
            plot_checked(fig.add_subplot(cells[i, 0]), scalars, name, thresholds, last=i == len(checked) - 1)
    if "loss" in scalars:  # a run that never trained (a device mismatch) has no loss
        loss = scalars.dropna(subset=["loss"])
        ax_loss.plot(loss["step"], loss["loss"], color="tab:blue", label="loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss", color="tab:blue")
    ax_loss.set_title("loss" + (f" and {key_scalar}" if key_scalar else ""))
    if key_scalar and key_scalar in scalars:
        key = scalars.dropna(subset=[key_scalar])
        ax_key = ax_loss.twinx()
        ax_key.plot(key["step"], key[key_scalar], color="tab:orange", marker=".", label=key_scalar)
        ax_key.set_ylabel(key_scalar, color="tab:orange")
        said = draw_thresholds(ax_key, key_thresholds, color="tab:orange")
        if said:  # in the title, never on the curves
            ax_loss.set_title(f"loss and {key_scalar} (dashed: {key_scalar} threshold {said})")

    if not modules.empty and "grad_norm" in modules:
        table = module_grad_norms(modules)
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.log10(table.to_numpy(dtype=float))
        values[~np.isfinite(values)] = np.nan  # none (no path) and zero show as blank
        image = ax_heat.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        steps = table.columns.to_numpy()
        ticks = np.linspace(0, len(steps) - 1, min(6, len(steps))).astype(int)
        ax_heat.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax_heat.set_yticks(range(len(table.index)), table.index)
        ax_heat.set_xlabel("step")
        ax_heat.set_title("log10 gradient norm per module (blank: none or zero)")
        bar = fig.colorbar(image, ax=ax_heat, fraction=0.04)
        bar.set_label("log10 gradient norm (L2 over the module's tensors)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def draw_thresholds(ax, thresholds: Sequence[float], color: str = "gray") -> str:
    """Each threshold a check compares a scalar with, as a dashed line; returns their values in
    words for the panel's title (a label beside the line would lie on the curve or the title)."""
    for threshold in thresholds:
        ax.axhline(threshold, color=color, linestyle="--", linewidth=0.8)
    return ", ".join(f"{t:.3g}" for t in thresholds)


def scale_moves(scalars: pd.DataFrame) -> bool:
    """Whether the run's loss scale changed (a dynamic scale that grew or backed off)."""
    return "loss_scale" in scalars and scalars["loss_scale"].dropna().nunique() > 1


def plot_loss_scale(ax, scalars: pd.DataFrame) -> None:
    """log2 of the loss scale at each logged step, with the skipped-step count beside it."""
    rows = scalars.dropna(subset=["loss_scale"])
    ax.step(rows["step"], np.log2(rows["loss_scale"].to_numpy(float)), where="post", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 loss scale", color="tab:green")
    ax.set_title("dynamic loss scale")
    if "skipped_steps" in rows:
        ax_skip = ax.twinx()
        ax_skip.plot(rows["step"], rows["skipped_steps"], color="tab:red", linestyle=":")
        ax_skip.set_ylabel("skipped steps (back-offs)", color="tab:red")


def plot_checked(ax, scalars: pd.DataFrame, name: str, thresholds: Sequence[float], last: bool) -> None:
    """One scalar a check reads, over steps, with the thresholds it is compared with."""
    rows = scalars.dropna(subset=[name])
    ax.plot(rows["step"], rows[name], color="tab:purple", marker="." if len(rows) < 30 else None)
    said = draw_thresholds(ax, thresholds)
    ax.set_title(f"{name} threshold {said} (dashed)" if said else f"{name} (checked)")  # short: the panel is narrow
    if last:
        ax.set_xlabel("step")
    else:  # the step axis is the last panel's: no tick labels under this one's curve, over the next title
        ax.tick_params(labelbottom=False)
