"""The two rules that set the precision experiments' regime, computed from the records of an
fp32 run made without the shift (``experiment=precision_fp32 precision.loss_shift=1``).

- **Shift** (``precision.loss_shift`` = 2^-k): the k whose shift makes the run's pooled share
  of non-zero activation gradients that fp16 flushes (at or below 2^-25) closest to SSD's:
  NVIDIA's mixed-precision guide reports that, converted to fp16, 31% of SSD's activation
  gradient values became zero and 5.3% stayed non-zero, so 31 / (31 + 5.3) = 85.4% of the
  non-zero values flushed (Micikevicius et al. 2018, Sec. 3.2, Fig. 3). A power-of-two shift
  moves every value by exactly k octaves, so the shifted share is read from the unshifted
  histogram with its bins moved (``flush_fraction``).
- **Growth interval** (``precision.scaler_growth_interval``): no gradient entry exceeds the
  gradient's norm, so at the shift c no weight gradient can overflow fp16 (65504) below the
  scale 65504 / (c G), G the largest logged gradient norm. Reaching it from GradScaler's
  initial scale takes n = log2(65504 / (c G)) - log2(init_scale) doublings; an interval of
  steps / (2 n) gets there by mid-run, so the second half holds the grow / overflow /
  back-off cycle.

``python -m gradrepro.analysis.precision_regime RUN_DIR`` prints both for one such run.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import pandas as pd

from gradrepro.probe.kernels import HIST_COLUMNS
from gradrepro.records.reader import read_run
from gradrepro.signature.metrics.precision import flush_fraction

SSD_FLUSH_SHARE = 31 / (31 + 5.3)  # NVIDIA's guide: 31% of values became zero, 5.3% stayed non-zero
FP16_MAX = 65504.0


def pooled_histogram(modules: pd.DataFrame) -> pd.Series:
    """The activation-gradient histogram summed over every module and logged step (weight
    and bias rows of a module carry the same counts: one row per step and module)."""
    rows = modules.drop_duplicates(["step", "module"])
    return rows[[c for c in HIST_COLUMNS if c in rows.columns]].sum()


def flush_share_by_octave(counts: pd.Series, octaves: Sequence[int] = range(0, 25)) -> Dict[int, float]:
    """Share of non-zero values fp16 flushes after a shift of 2^-k, for each k."""
    return {k: flush_fraction(counts, at_scale_ratio=2.0**-k) for k in octaves}


def shift_octaves(counts: pd.Series, target: float = SSD_FLUSH_SHARE) -> int:
    """The k whose shift 2^-k puts the flush share closest to ``target``."""
    shares = flush_share_by_octave(counts)
    return min(shares, key=lambda k: abs(shares[k] - target))


def growth_interval(steps: int, max_grad_norm: float, shift: float, init_scale: float = 65536.0) -> int:
    """GradScaler's growth interval that reaches the first scale at which a gradient can
    overflow fp16 by mid-run (the module docstring's rule), at least 1."""
    doublings = math.log2(FP16_MAX / (shift * max_grad_norm)) - math.log2(init_scale)
    return max(1, round(steps / (2 * doublings))) if doublings > 0 else 1


def regime(run_dir: Path, target: float = SSD_FLUSH_SHARE) -> Dict[str, float]:
    """Both rules on one unshifted fp32 run: k, its share, the neighbours' shares, the interval."""
    run = read_run(Path(run_dir))
    modules, scalars = run.modules(), run.scalars()
    counts = pooled_histogram(modules)
    k = shift_octaves(counts, target)
    shares = flush_share_by_octave(counts, (k - 1, k, k + 1))
    steps = int(run.summary.get("steps") or scalars["step"].max() + 1)
    max_norm = float(scalars["grad_norm"].max())
    return {"k": k, "share": shares[k], "share_k_minus_1": shares[k - 1], "share_k_plus_1": shares[k + 1],
            "target": target, "max_grad_norm": max_norm,
            "growth_interval": growth_interval(steps, max_norm, 2.0**-k)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradrepro.analysis.precision_regime",
                                     description="The loss shift and growth interval from an unshifted fp32 run.")
    parser.add_argument("runs", nargs="+", type=Path, help="folders of precision_fp32 runs with precision.loss_shift=1")
    args = parser.parse_args(argv)
    rows = []
    for run_dir in args.runs:
        try:
            rows.append({"run": str(run_dir), **regime(run_dir)})
        except (ValueError, OSError, KeyError) as exc:
            print(f"{run_dir}: {exc}", file=sys.stderr)
            return 2
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
