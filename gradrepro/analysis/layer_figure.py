"""Figures that compare runs layer by layer, read from their run folders.

- ``plot_inits``: the loss curves of several runs (He et al.'s Fig. 3: Kaiming, Xavier,
  std 0.01) in one panel, next to one heat map per run of a per-layer statistic over steps
  (default: log10 of the back-propagated gradient's std at each weight layer's output).
- ``plot_layer_profiles``: per layer, two statistics side by side (Glorot & Bengio's Figs.
  7-8: per-example back-propagated vs weight-gradient variance), one line per run and step.

``python -m gradrepro.analysis.layer_figure inits RUN_DIR... --out fig.png``
``python -m gradrepro.analysis.layer_figure profiles RUN_DIR... --out fig.png [--steps 0 10 50]``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradrepro.records.files import atomic_write
from gradrepro.records.reader import read_run
from gradrepro.signature.metrics.layers import select


def layer_table(modules: pd.DataFrame, column: str) -> pd.DataFrame:
    """weight layer x step table of ``column`` (network order)."""
    rows = modules[modules["param"] == "weight"]
    table = rows.pivot_table(index="module", columns="step", values=column, aggfunc="first",
                             dropna=False)
    order = list(dict.fromkeys(rows["module"]))
    return table.reindex([m for m in order if m in table.index])


def _label(summary: dict, run_dir: Path) -> str:
    overrides = [o for o in summary.get("overrides", []) if not o.startswith(("experiment=", "seed="))]
    name = summary.get("experiment", run_dir.name)
    return f"{name} {' '.join(overrides)} (seed {summary.get('seed')})".strip()


def plot_inits(run_dirs: Sequence[Path], path: Path, column: str = "act_grad_std",
               title: Optional[str] = None) -> None:
    runs = []
    for d in run_dirs:
        run = read_run(Path(d))
        runs.append((Path(d), run.summary, run.scalars(), run.modules()))
    fig = Figure(figsize=(5 + 4 * len(runs), 5))
    axes = fig.subplots(1, 1 + len(runs), gridspec_kw={"width_ratios": [1.3] + [1] * len(runs)})
    ax_loss = axes[0]
    tables = []
    for run_dir, summary, scalars, modules in runs:
        loss = scalars.dropna(subset=["loss"])
        ax_loss.plot(loss["step"], loss["loss"], label=_label(summary, run_dir))
        with np.errstate(divide="ignore", invalid="ignore"):
            tables.append(np.log10(layer_table(modules, column)))
    ax_loss.axhline(np.log(10), color="grey", linestyle=":", label="ln 10")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.legend(fontsize=7)
    ax_loss.set_title("loss")
    finite = np.concatenate([t.to_numpy(dtype=float).ravel() for t in tables])
    finite = finite[np.isfinite(finite)]
    vmin, vmax = (finite.min(), finite.max()) if finite.size else (0, 1)
    image = None
    for ax, table, (run_dir, summary, _, _) in zip(axes[1:], tables, runs):
        values = np.array(table.to_numpy(dtype=float))  # a writable copy
        values[~np.isfinite(values)] = np.nan  # zero or none: blank
        image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis",
                          vmin=vmin, vmax=vmax)
        steps = table.columns.to_numpy()
        ticks = np.linspace(0, len(steps) - 1, min(5, len(steps))).astype(int)
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        ax.set_yticks(range(len(table.index)), table.index, fontsize=5)
        ax.set_xlabel("step")
        ax.set_title(summary.get("experiment", run_dir.name), fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=list(axes[1:]), fraction=0.03, label=f"log10 {column}")
    fig.suptitle(title or f"loss, and log10 {column} per weight layer (input at top)")
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))


def plot_layer_profiles(run_dirs: Sequence[Path], path: Path,
                        columns: Sequence[str] = ("pe_act_grad_var", "pe_grad_var"),
                        steps: Sequence[int] = (0,), layers: str = "linear[:-1]",
                        title: Optional[str] = None) -> None:
    """Each statistic per layer, relative to the last layer of ``layers``, on a log axis."""
    fig = Figure(figsize=(5.5 * len(columns), 4.5))
    axes = np.atleast_1d(fig.subplots(1, len(columns), sharey=True))
    for d in run_dirs:
        run = read_run(Path(d))
        summary, modules = run.summary, run.modules()
        names = select(modules, layers)
        for step in steps:
            for ax, column in zip(axes, columns):
                table = layer_table(modules, column)
                if step not in table.columns:
                    continue
                series = table.loc[names, step].to_numpy(dtype=float)
                ax.plot(range(1, len(names) + 1), series / series[-1], marker="o",
                        label=f"{summary.get('experiment')} step {step} (seed {summary.get('seed')})")
    for ax, column in zip(axes, columns):
        ax.set_yscale("log")
        ax.set_xlabel("hidden layer (1 = nearest the input)")
        ax.set_title(column)
        ax.axhline(1.0, color="grey", linestyle=":")
    axes[0].set_ylabel("relative to the last hidden layer")
    axes[-1].legend(fontsize=7)
    fig.suptitle(title or "per-example variances per layer")
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradrepro.layer_figure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("inits", "profiles"))
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--column", default="act_grad_std")
    parser.add_argument("--steps", type=int, nargs="+", default=[0])
    args = parser.parse_args(argv)
    if args.kind == "inits":
        plot_inits(args.runs, args.out, args.column)
    else:
        plot_layer_profiles(args.runs, args.out, steps=args.steps)
    print(args.out)


if __name__ == "__main__":
    main()
