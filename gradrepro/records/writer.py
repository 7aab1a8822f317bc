"""A run's records while it trains: kept in memory, written to the run folder atomically
(``files.atomic_write``) on a flush."""

from __future__ import annotations

import os
import time
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
# A rewrite takes time in proportion to the rows so far (1M module rows: about 1 s on one CPU
# core), so a fixed period would let it grow into a tenth of a long run's time. The period is
# stretched to the last write's duration over WRITE_SHARE: the rewrites then take at most that
# share of the wall time between them, at the price of more steps since the last write on disk.
WRITE_SHARE = 0.01


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
        self._period = flush_seconds()
        self._written_at: Optional[float] = None  # time.monotonic() at the end of the last write
        self._write_seconds = 0.0  # how long it took

    def due(self) -> bool:
        """Whether a write during the run is due: none yet, or the period (``FLUSH_SECONDS``,
        stretched by ``WRITE_SHARE`` for long runs; 0: always) has passed since the last."""
        if self._written_at is None or self._period <= 0:
            return True
        period = max(self._period, self._write_seconds / WRITE_SHARE)
        return time.monotonic() - self._written_at > period

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
        started = time.monotonic()
        try:
            return self._write_all()
        finally:
            self._written_at = time.monotonic()
            self._write_seconds = self._written_at - started

    def _write_all(self) -> List[str]:
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
