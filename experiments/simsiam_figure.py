"""The SimSiam dynamics figure: per run, over the training steps, the loss, z_std and p_std, the
projector's output variance before its output BN against BN's eps (median and smallest
channel), the learning rate and the update-to-weight ratio of the last projector fc (the step
the pre-BN output actually takes), and the linear probe at each evaluation.

    python experiments/simsiam_figure.py RUN_DIR [RUN_DIR ...] --out experiments/figures/simsiam_dynamics.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

BN_EPS = 1e-5  # torch.nn.BatchNorm1d's default, the projector's output BN


def run_config(run: Path) -> dict:
    """The run's composed config as Hydra saved it (plain YAML, read without resolving)."""
    import yaml

    path = run / ".hydra" / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def last_projector_fc(modules: pd.DataFrame) -> pd.DataFrame:
    """The update-to-weight ratio of the projector's last fc (the one before the output BN)."""
    weights = modules[(modules["param"] == "weight") & modules["module"].str.startswith("projector.")]
    fcs = sorted(weights["module"].unique(), key=lambda m: int(m.split(".")[1]))
    return weights[weights["module"] == fcs[-1]].sort_values("step")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("experiments/figures/simsiam_dynamics.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ("loss", "z_std", "p_std", "zpre_var", "lr and step", "linear_acc")
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    axes = dict(zip(panels, axes.ravel()))
    colors = {"simsiam_baseline": "tab:blue", "simsiam_nostopgrad": "tab:red",
              "simsiam_nopredictor": "tab:green", "simsiam_frozen_predictor": "tab:purple"}
    seen = set()
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        name = summary["experiment"]
        color = colors.get(name, "gray")
        label = None if name in seen else name
        seen.add(name)
        style = "-" if summary.get("reproduced") else ":"
        scalars = pd.read_parquet(run / "scalars.parquet")
        train = scalars.dropna(subset=["loss"])
        for key in ("loss", "z_std", "p_std"):
            axes[key].plot(train["step"], train[key], style, color=color, lw=1, label=label)
        axes["zpre_var"].plot(train["step"], train["zpre_var"], style, color=color, lw=1, label=label)
        axes["zpre_var"].plot(train["step"], train["zpre_var_min"], style, color=color, lw=0.5, alpha=0.5)
        fc = last_projector_fc(pd.read_parquet(run / "modules.parquet"))
        axes["lr and step"].plot(fc["step"], fc["update_to_param"], style, color=color, lw=1, label=label)
        evals = scalars.dropna(subset=["linear_acc"])
        init = summary.get("constants", {}).get("linear_acc_init")
        steps, accs = list(evals["step"]), list(evals["linear_acc"])
        if init is not None and (not steps or steps[0] != 0):
            steps, accs = [0, *steps], [init, *accs]
        axes["linear_acc"].plot(steps, accs, style, marker="o", ms=3, color=color, lw=1, label=label)
    d = run_config(args.runs[-1]).get("objective", {}).get("dim")
    axes["zpre_var"].axhline(BN_EPS, color="k", lw=0.8, ls="--")
    axes["zpre_var"].text(0, BN_EPS * 1.3, "BN eps", fontsize=8)
    axes["zpre_var"].set_yscale("log")
    axes["lr and step"].set_yscale("log")
    lr_ax = axes["lr and step"].twinx()
    lr_ax.plot(train["step"], train["lr"], color="k", lw=0.8, ls="--")
    lr_ax.set_ylabel("lr (backbone and projector; dashed)")
    titles = {
        "loss": "loss (minimum -1)",
        "z_std": "z_std (healthy 1/sqrt(d), collapsed 0; threshold dotted)",
        "p_std": "p_std (the predictor's output)",
        "zpre_var": "projector output variance before its BN (median; min thin)",
        "lr and step": "update / weight of the last projector fc",
        "linear_acc": "linear probe on the frozen backbone (chance dotted)",
    }
    for key, ax in axes.items():
        ax.set_title(titles[key], fontsize=9)
        ax.set_xlabel("step")
    if d:
        axes["z_std"].axhline(0.5 / d**0.5, color="k", lw=0.8, ls=":")
    axes["linear_acc"].axhline(0.1, color="k", lw=0.8, ls=":")
    axes["loss"].legend(fontsize=8)
    fig.suptitle("SimSiam dynamics (solid: signature reproduced; dotted: not)", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(args.out)


if __name__ == "__main__":
    main()
