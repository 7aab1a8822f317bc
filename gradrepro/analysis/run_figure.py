"""signals.png: the loss curve (and the key scalar) next to a per-module heat map of
gradient norm over steps: a falling loss beside the modules that actually got signal."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradrepro.records.files import atomic_write


def module_grad_norms(modules: pd.DataFrame) -> pd.DataFrame:
    """module x step table of each module's gradient norm (its tensors combined, L2)."""
    df = modules[["step", "module", "grad_norm"]].copy()
    df["sq"] = df["grad_norm"] ** 2
    table = df.pivot_table(index="module", columns="step", values="sq", aggfunc="sum", dropna=False)
    order = list(dict.fromkeys(modules["module"]))  # network order, not alphabetical
    return np.sqrt(table.reindex([m for m in order if m in table.index]))


def plot_signals(
    scalars: pd.DataFrame,
    modules: pd.DataFrame,
    path: Path,
    title: str,
    key_scalar: Optional[str] = None,
) -> None:
    fig = Figure(figsize=(13, 5))  # no pyplot: the caller's backend and figures stay as they are
    moving = scale_moves(scalars)
    if moving:
        ax_loss, ax_heat, ax_scale = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.4, 0.8]})
        plot_loss_scale(ax_scale, scalars)
    else:
        ax_loss, ax_heat = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
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

    if not modules.empty and "grad_norm" in modules:
        table = module_grad_norms(modules)
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.log10(table.to_numpy(dtype=float))
        values[~np.isfinite(values)] = np.nan  # none (no path) and zero show as blank
        image = ax_heat.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        steps = table.columns.to_numpy()
        ticks = np.linspace(0, len(steps) - 1, min(6, len(steps))).astype(int)
        ax_heat.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax_heat.set_yticks(range(len(table.index)), table.index, fontsize=7)
        ax_heat.set_xlabel("step")
        ax_heat.set_title("log10 gradient norm per module (blank: none or zero)")
        fig.colorbar(image, ax=ax_heat, fraction=0.04)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


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
