"""The precision figure: pooled activation-gradient histograms (fp32 vs fp16 unscaled vs
scaled, fp16 limits marked) beside the loss curves.

    python experiments/precision_figure.py RUN_DIR [RUN_DIR ...] --out experiments/precision.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from gradrepro.probe.kernels import HIST_COLUMNS, HIST_EDGES


def pooled_histogram(modules: pd.DataFrame) -> pd.Series:
    """Counts per bin, every module and logged step pooled (as the paper's Fig. 3)."""
    return modules.drop_duplicates(["step", "module"])[HIST_COLUMNS].sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("experiments/precision.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_h, ax_l) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    octaves = np.array(HIST_EDGES[:-1], dtype=float)
    x = np.concatenate([[-42.0, -41.0], octaves, [0.0]])  # zero bin, below 2^-40, octaves, >= 1
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        name = summary["experiment"].replace("precision_", "")
        counts = pooled_histogram(pd.read_parquet(run / "modules.parquet")).to_numpy(dtype=float)
        ax_h.step(x, counts / counts.sum(), where="post", label=name)
        scalars = pd.read_parquet(run / "scalars.parquet").dropna(subset=["loss"])
        ax_l.plot(scalars["step"], scalars["loss"], label=name)
    for edge, label in ((-24, "2^-24 smallest subnormal"), (-14, "2^-14 smallest normal")):
        ax_h.axvline(edge, color="k", ls="--" if edge == -24 else ":", lw=1)
        ax_h.text(edge + 0.2, ax_h.get_ylim()[1] * 0.9, label, fontsize=8)
    ax_h.axvspan(-27, -24, color="tab:red", alpha=0.08, label="[2^-27, 2^-24): SSD's lost band")
    ax_h.set_xticks([-42, -40, -35, -30, -27, -24, -20, -14, -10, -5, 0],
                    ["zero", "-40", "-35", "-30", "-27", "-24", "-20", "-14", "-10", "-5", ">=0"])
    ax_h.set_xlabel("log2 |activation gradient| as carried in backward (scaled); left bin: exact zeros")
    ax_h.set_ylabel("fraction of values (all modules, all logged steps)")
    ax_h.set_title("activation-gradient histogram (Micikevicius et al. 2018, Fig. 3 at our scale)")
    ax_h.legend(fontsize=8)
    ax_l.set_yscale("log")
    ax_l.set_xlabel("step")
    ax_l.set_ylabel("training loss")
    ax_l.set_title("loss")
    ax_l.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
