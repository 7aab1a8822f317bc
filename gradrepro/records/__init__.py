"""Write and read a run folder (summary.json, scalars.parquet, modules.parquet, the figure).

Writing: ``open_records`` (in memory during a run, flushed atomically), ``files.write_json``.
Reading: ``read_run(path)`` -> ``Run`` (a folder as found, incomplete ones included), whose
``records()`` is the one record type, ``RunRecords``, that signatures evaluate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gradrepro.records.files import FIGURE, MODULES, SCALARS, SUMMARY
from gradrepro.records.reader import Run, find_run_dirs, load_runs, read_run
from gradrepro.records.run import RunRecords
from gradrepro.records.tensorboard import TensorBoardRecords
from gradrepro.records.writer import Records

# logger=...: the plain writer, or one that also writes TensorBoard event files.
LOGGERS = ("none", "tensorboard")


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401 - an optional extra
    except ImportError:
        return False
    return True


def open_records(logger_cfg: Any, run_dir: Path, net: nn.Module) -> Records:
    """The run's records object: plain, or also writing to TensorBoard (``logger.name``)."""
    if logger_cfg is None or logger_cfg.name == "none":
        return Records(run_dir)
    return TensorBoardRecords(run_dir, net, Path(run_dir) / logger_cfg.folder, logger_cfg.histograms)


__all__ = ["FIGURE", "LOGGERS", "MODULES", "SCALARS", "SUMMARY", "Records", "Run", "RunRecords",
           "find_run_dirs", "load_runs", "open_records", "read_run", "tensorboard_available"]
