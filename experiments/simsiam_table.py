"""The SimSiam page's per-seed tables: one markdown row per run folder under the given sweeps.

    python experiments/simsiam_table.py SWEEP_DIR [SWEEP_DIR ...]

Linear and k-NN accuracy: the evaluation at init and at the end; z_std, p_std and the loss:
the mean of the last 3 logged batches (as the signature's window); the lowest p_std logged
and its step (the dip a control comes back from, or stays in: the page's "stuck" state); the
data's background std (the nuisance); the verdict and the evidence checks that failed: the
run's own summary.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import yaml


def row(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    scalars = pd.read_parquet(run / "scalars.parquet")
    evals = scalars.dropna(subset=["linear_acc"])
    last = {c: float(scalars[c].dropna().iloc[-3:].mean()) for c in ("z_std", "p_std", "loss")}
    p_std = scalars.dropna(subset=["p_std"])
    lowest = p_std.loc[p_std["p_std"].idxmin()]
    config = run / ".hydra" / "config.yaml"
    data = (yaml.safe_load(config.read_text()) or {}).get("data", {}) if config.is_file() else {}
    failed = [c["metric"] for c in summary["checks"] if c["role"] == "evidence" and not c["ok"]]
    return {
        "experiment": summary["experiment"], "seed": summary["seed"],
        "linear acc at init": f"{evals['linear_acc'].iloc[0]:.3f}",
        "linear acc final": f"{evals['linear_acc'].iloc[-1]:.3f}",
        "k-NN final": f"{evals['knn_acc'].iloc[-1]:.3f}", "z_std final": f"{last['z_std']:.4f}",
        "p_std final": f"{last['p_std']:.4f}",
        "p_std lowest (step)": f"{lowest['p_std']:.3f} ({int(lowest['step'])})",
        "background std": data.get("background_std", "?"), "final loss": f"{last['loss']:.3f}",
        "verdict": "REPRODUCED" if summary["reproduced"] else "NOT REPRODUCED",
        "evidence checks failed": ", ".join(failed) or "-", "wall s": f"{summary['wall_s']:.0f}",
    }


def main(sweeps: list[str]) -> None:
    runs = sorted({p.parent for s in sweeps for p in Path(s).rglob("summary.json")})
    rows = sorted((row(r) for r in runs), key=lambda r: (r["experiment"], r["seed"]))
    if not rows:
        sys.exit(f"simsiam_table: no run folder (summary.json) under {', '.join(sweeps)}")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    left = ("experiment", "verdict", "evidence checks failed")
    print("| " + " | ".join(":--" if c in left else "--:" for c in cols) + " |")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    for name in sorted({r["experiment"] for r in rows}):
        mine = [r for r in rows if r["experiment"] == name]
        print(f"\n{name}: REPRODUCED on {sum(r['verdict'] == 'REPRODUCED' for r in mine)} of {len(mine)}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python experiments/simsiam_table.py SWEEP_DIR [SWEEP_DIR ...]")
    main(sys.argv[1:])
