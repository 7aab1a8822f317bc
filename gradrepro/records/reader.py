"""Finding and reading run folders: whatever is readable, with a reason for whatever is not.

A run folder is any folder holding ``summary.json``, ``.hydra/config.yaml`` or
``scalars.parquet``; a sweep folder is any folder above some. A run killed mid-way (no
``summary.json``, or ``status: interrupted``) and a recording still in progress (``status:
running``, written by ``gradrepro.record``) are kept and marked incomplete; a folder
whose summary cannot be read is skipped, and the reason is returned beside the runs.

Every file is read as untrusted data (``records/untrusted.py``): regular files only, sizes
and nesting bounded, types checked against the contract (``records/summary_schema.py``), and
no interpolation of a run's config is ever evaluated: a run's signature is the resolved one
its summary recorded. Atomic-write temporaries (``.NAME.*.tmp``) are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
import pyarrow.parquet as pq

from gradrepro.records.files import INFINITIES, MODULES, SCALARS, SUMMARY
from gradrepro.records.run import RunRecords
from gradrepro.records.summary_schema import SummaryError, check_summary, signature_entry
from gradrepro.records.untrusted import load_json, load_yaml, one_line, open_regular, parquet_budget

# Statuses of a run that did not finish: stopped by a signal, or (gradrepro.record) still recording.
INCOMPLETE = ("interrupted", "running")
HYDRA_CONFIG = Path(".hydra") / "config.yaml"
HYDRA_OVERRIDES = Path(".hydra") / "overrides.yaml"
_MARKERS = (SUMMARY, str(HYDRA_CONFIG), SCALARS)
# A reference run (run_dir/references/NAME) belongs to the run that made it, not a row of its own.
_IGNORED_PARTS = {".submitit", ".hydra", "tensorboard", "references"}


# A record table's text columns; every other column is numeric (the contract in README.md).
TEXT_COLUMNS = {SCALARS: (), MODULES: ("module", "param", "param_type", "grad_state")}


def read_table(path: Path, columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
    """A record table (scalars.parquet or modules.parquet) read as untrusted data: a regular
    file, no larger once read than half the machine's memory, with a numeric ``step`` column
    and numeric columns where the contract has numbers."""
    path = Path(path)
    with open_regular(path) as f:
        parquet = pq.ParquetFile(f)
        meta = parquet.metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        budget = parquet_budget()
        if budget is not None and size > budget:
            raise ValueError(f"{path.name} would take {size} bytes once read (more than half this "
                             "machine's memory): not read")
        df = parquet.read(columns=list(columns) if columns else None).to_pandas()
    if "step" not in df or not pd.api.types.is_numeric_dtype(df["step"]) or pd.api.types.is_bool_dtype(df["step"]):
        raise ValueError(f"{path.name} has no numeric 'step' column")
    text = TEXT_COLUMNS.get(path.name, ())
    for col in df.columns:
        numeric = pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col])
        if col not in text and not numeric:
            raise ValueError(f"{path.name}: column {one_line(col, 80)!r} is not numeric")
    return df


@dataclass
class Run:
    """One run folder as far as it could be read."""

    path: Path
    summary: Dict[str, Any]
    overrides: Dict[str, str]
    complete: bool
    final_loss: float = math.nan
    notes: List[str] = field(default_factory=list)

    @property
    def experiment(self) -> str:
        return str(self.summary.get("experiment") or "?")

    @property
    def control(self) -> Optional[str]:
        return self.summary.get("control")

    @property
    def status(self) -> str:
        status = self.summary.get("status")
        if status is None:
            return "incomplete (no summary.json)"
        if self.summary.get("missing"):
            return f"incomplete ({status}; records not all written)"
        return f"incomplete ({status})" if status in INCOMPLETE else str(status)

    def scalars(self) -> pd.DataFrame:
        return read_table(self.path / SCALARS)

    def modules(self, columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
        return read_table(self.path / MODULES, columns)

    def records(self, references: bool = True) -> RunRecords:
        """The run's records as signatures read them: scalars, modules, the constants of
        summary.json (null read as NaN, "inf" as inf), and the reference runs it made, from their folders
        (strictly inside this one; a reference run's own references are not followed)."""
        constants = self.summary.get("constants") or {}
        made = {}
        for name, entry in (self.summary.get("references") or {}).items() if references else ():
            folder = (self.path / str(entry.get("run_dir", f"references/{name}"))).resolve()
            if self.path.resolve() not in folder.parents:
                raise ValueError(f"reference {one_line(name, 80)!r} is not a folder inside the run folder")
            made[name] = read_run(folder).records(references=False)
        return RunRecords(self.scalars(), self.modules(),
                          {k: json_number(v) for k, v in constants.items()},
                          made)


def json_number(value: Any) -> Any:
    """A number as summary.json writes it, back as a float: null is NaN, "inf" and "-inf" are
    infinite (records/files.py); anything else is returned as it is."""
    if value is None:
        return math.nan
    if isinstance(value, str) and value in INFINITIES:
        return INFINITIES[value]
    return value


def parse_overrides(items: Sequence[str]) -> Dict[str, str]:
    """``["experiment=x", "+a.b=1", "~c"]`` -> ``{"experiment": "x", "a.b": "1"}``."""
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+")
        if sep and not key.startswith(("~", "hydra.", "hydra/")):
            out[key] = value
    return out


def find_run_dirs(path: Path) -> List[Path]:
    """Run folders at or below ``path`` (sorted; Submitit's and Hydra's own folders left out)."""
    path = Path(path)
    if any((path / marker).exists() for marker in _MARKERS):
        return [path]
    found = set()
    for marker in (SUMMARY, "config.yaml", SCALARS):
        for hit in path.rglob(marker):
            parent = hit.parent.parent if hit.name == "config.yaml" else hit.parent
            if hit.name == "config.yaml" and hit.parent.name != ".hydra":
                continue
            if not _IGNORED_PARTS.intersection(parent.relative_to(path).parts):
                found.add(parent)
    return sorted(found)


def _from_hydra_record(run_dir: Path) -> Tuple[Dict[str, Any], List[str]]:
    """What Hydra's own record says about a run that wrote no summary: its name, control and
    seed (plain YAML, nothing resolved), and its overrides."""
    try:
        cfg = load_yaml(run_dir / HYDRA_CONFIG)
        listed = load_yaml(run_dir / HYDRA_OVERRIDES) if (run_dir / HYDRA_OVERRIDES).exists() else []
    except (OSError, ValueError) as exc:
        raise ValueError(f"no {SUMMARY}, and .hydra/ is unreadable ({one_line(exc, 200)})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"no {SUMMARY}, and .hydra/config.yaml holds no config")
    summary = {"experiment": cfg.get("name"), "control": cfg.get("control"), "seed": cfg.get("seed")}
    try:
        check_summary(summary)
    except SummaryError as exc:
        raise ValueError(f"no {SUMMARY}, and .hydra/config.yaml: {exc}") from None
    if not isinstance(listed, list) or not all(isinstance(o, str) for o in listed):
        listed = []
    return {**summary, "status": None}, listed


def read_summary(run_dir: Path) -> Dict[str, Any]:
    """summary.json, type-checked; ``ValueError`` naming what is wrong."""
    try:
        summary = load_json(Path(run_dir) / SUMMARY)
    except OSError as exc:
        raise ValueError(f"{SUMMARY} is unreadable ({type(exc).__name__}: {one_line(exc, 200)})") from None
    except ValueError as exc:
        raise ValueError(f"{SUMMARY} is unreadable ({one_line(exc, 300)})") from None
    if not isinstance(summary, dict) or "experiment" not in summary:
        raise ValueError(f"{SUMMARY} has no 'experiment' entry (not a gradrepro run?)")
    try:
        return check_summary(summary)
    except SummaryError as exc:
        raise ValueError(f"{SUMMARY} is not a gradrepro summary: {one_line(exc, 300)}") from None


def _check_against_hydra_record(run_dir: Path, summary: Dict[str, Any]) -> None:
    """A summary.json that names another experiment (or control) than the run's own Hydra
    record (``.hydra/config.yaml``, plain values only) was edited or copied in: ValueError,
    so the run is skipped with one warning rather than listed under a name it did not run."""
    if not (run_dir / HYDRA_CONFIG).is_file():
        return  # a recorder's run, or a reference run: no Hydra record to compare with
    try:
        cfg = load_yaml(run_dir / HYDRA_CONFIG)
    except (OSError, ValueError):
        return  # an unreadable record says nothing either way
    if not isinstance(cfg, dict):
        return
    for key, field_name in (("name", "experiment"), ("control", "control")):
        own = cfg.get(key)
        if not isinstance(own, str) or "${" in own or field_name not in summary:
            continue
        if str(summary.get(field_name)) != own:
            raise ValueError(f"{SUMMARY} says {field_name} {one_line(summary.get(field_name), 80)!r} but the "
                             f"run's own .hydra/config.yaml says {one_line(own, 80)!r} (edited or copied "
                             "in?): skipped")


def read_run(run_dir: Path) -> Run:
    """Read one run folder. Raises ``ValueError`` with the reason when it cannot be used."""
    run_dir = Path(run_dir)
    notes = []
    if (run_dir / SUMMARY).exists() or (run_dir / SUMMARY).is_symlink():
        summary = read_summary(run_dir)
        _check_against_hydra_record(run_dir, summary)
        overrides = parse_overrides(summary.get("overrides") or [])
    else:
        # Killed before the end: Hydra's own record of the job says what it was.
        summary, listed = _from_hydra_record(run_dir)
        overrides = parse_overrides(listed)
        notes.append(f"no {SUMMARY} (killed mid-way?): listed as incomplete")
    complete = summary.get("status") not in (None, *INCOMPLETE) and not summary.get("missing")
    run = Run(run_dir, summary, overrides, complete, notes=notes)
    if summary.get("missing"):
        run.notes.append("records not all written: " + one_line("; ".join(summary["missing"]), 300))
    try:
        scalars = run.scalars()
        if "loss" in scalars:
            losses = scalars["loss"].dropna()
            run.final_loss = float(losses.iloc[-1]) if len(losses) else math.nan
    except FileNotFoundError:
        run.notes.append(f"no {SCALARS}: final loss and curves left out")
    except Exception as exc:  # noqa: BLE001 - anything a hostile or truncated file raises
        run.notes.append(f"{SCALARS} is unreadable ({type(exc).__name__}: {one_line(exc, 200)}): "
                         "final loss and curves left out")
    return run


def load_runs(paths: Sequence[Path]) -> Tuple[List[Run], List[str]]:
    """Every readable run under ``paths``; one warning line per folder skipped or partly read."""
    runs, warnings = [], []
    seen = set()
    for path in map(Path, paths):
        if not path.exists():
            warnings.append(f"{one_line(path)}: does not exist")
            continue
        dirs = find_run_dirs(path)
        if not dirs:
            warnings.append(
                f"{one_line(path)}: no runs found (no {SUMMARY}, .hydra/ or "
                f"{SCALARS} at or below it)"
            )
        for run_dir in dirs:
            key = run_dir.resolve()
            if key in seen:
                continue
            seen.add(key)
            try:
                run = read_run(run_dir)
            except (ValueError, OSError, RecursionError) as exc:
                warnings.append(f"{one_line(run_dir)}: skipped: {one_line(exc)}")
                continue
            warnings.extend(f"{one_line(run_dir)}: {one_line(note)}" for note in run.notes)
            runs.append(run)
    return runs, warnings


def signature_of(run: Run) -> Optional[Dict[str, Any]]:
    """The run's signature (checks with their params) as the run resolved it: the one its
    summary recorded. A run from before summaries recorded it: the signature of its
    ``.hydra/config.yaml`` if it is plain data; one with an interpolation (``${...}``) is
    refused (None), since evaluating a folder's interpolations would run its code."""
    recorded = run.summary.get("signature")
    if recorded is not None:
        return recorded
    try:
        cfg = load_yaml(run.path / HYDRA_CONFIG)
        signature = cfg.get("signature") if isinstance(cfg, dict) else None
        if signature is None or _has_interpolation(signature):
            return None
        signature_entry("signature", signature)
        return signature
    except (OSError, ValueError):
        return None


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(k) or _has_interpolation(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


__all__ = ["Run", "find_run_dirs", "load_runs", "read_run", "read_summary", "read_table", "signature_of"]
