"""A run's records while it trains: kept in memory, written to the run folder atomically
(``files.atomic_write``) on a flush."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from gradrepro.errors import UserError
from gradrepro.records.files import MODULES, SCALARS, atomic_write

# Records are rewritten (atomically) right after the first logged step, then at most every
# FLUSH_SECONDS during a run, and at the end. GRADREPRO_FLUSH_SECONDS changes the period
# (tests use 0: a write on every logged step, to kill a run in the middle of one).
FLUSH_SECONDS = 10.0


def flush_seconds() -> float:
    value = os.environ.get("GRADREPRO_FLUSH_SECONDS", str(FLUSH_SECONDS))
    try:
        return float(value)
    except ValueError:
        raise UserError(f"GRADREPRO_FLUSH_SECONDS={value!r} must be a number of seconds") from None


class Records:
    """Scalars (one row per logged step) and module rows (one per logged step x tensor)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.scalar_rows: List[Dict[str, float]] = []
        self.module_blocks: List[Dict[str, np.ndarray]] = []
        self.saved_through: Dict[str, Optional[int]] = {}  # file -> last step it holds on disk

    def add_scalars(self, row: Dict[str, float]) -> None:
        self.scalar_rows.append(row)

    def add_modules(self, columns: Dict[str, np.ndarray]) -> None:
        self.module_blocks.append(columns)

    def scalars(self) -> pd.DataFrame:
        df = pd.DataFrame(self.scalar_rows)
        if df.empty:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "loss": pd.Series(dtype="float64")})
        # Training and evaluation may both log a step: one row per step, first value wins.
        return df.groupby("step", sort=True).first().reset_index()

    def modules(self) -> pd.DataFrame:
        if not self.module_blocks:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "module": pd.Series(dtype="object")})
        keys = list(self.module_blocks[0])
        for block in self.module_blocks[1:]:
            keys += [k for k in block if k not in keys]
        columns = {}
        for key in keys:
            parts = []
            for block in self.module_blocks:
                n = len(block["step"])
                parts.append(block[key] if key in block else np.full(n, np.nan))
            columns[key] = np.concatenate(parts)
        return pd.DataFrame(columns)

    def close(self) -> None:
        """Release whatever a subclass holds open (a logger's writer); the files stay."""

    def write_all(self) -> List[str]:
        """Write both Parquet files (atomically), each on its own: one that cannot be written
        (a full disk) leaves its last complete version in place. Returns one line per file
        not written, saying what its file on disk holds instead."""
        missing = []
        for name, frame in ((SCALARS, self.scalars()), (MODULES, self.modules())):
            try:
                atomic_write(self.run_dir / name, lambda tmp, f=frame: f.to_parquet(tmp, index=False))
            except OSError as exc:
                kept = self.saved_through.get(name)
                held = (f"it holds the steps up to {kept} (an earlier write)" if kept is not None
                        else "no earlier write exists")
                missing.append(f"{name}: not written ({exc.strerror or exc}); {held}")
                continue
            steps = frame["step"] if "step" in frame and len(frame) else None
            self.saved_through[name] = int(steps.max()) if steps is not None else None
        return missing

    def flush(self) -> None:
        """Write both Parquet files (atomically); safe to call at any time. OSError if one
        could not be written (the other still is)."""
        missing = self.write_all()
        if missing:
            raise OSError("; ".join(missing))
