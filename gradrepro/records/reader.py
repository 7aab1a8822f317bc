"""Finding and reading run folders: whatever is readable, with a reason for whatever is not.

A run folder is any folder holding ``summary.json``, ``.hydra/config.yaml`` or
``scalars.parquet``; a sweep folder is any folder above some. A run killed mid-way (no
``summary.json``, or ``status: interrupted``) is kept and marked incomplete; a folder
whose summary cannot be read is skipped, and the reason is returned beside the runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
from omegaconf import OmegaConf

from gradrepro.config.resolvers import register_resolvers
from gradrepro.records.files import INFINITIES, MODULES, SCALARS, SUMMARY
from gradrepro.records.run import RunRecords

HYDRA_CONFIG = Path(".hydra") / "config.yaml"
HYDRA_OVERRIDES = Path(".hydra") / "overrides.yaml"
_MARKERS = (SUMMARY, str(HYDRA_CONFIG), SCALARS)
# A reference run (run_dir/references/NAME) belongs to the run that made it, not a row of its own.
_IGNORED_PARTS = {".submitit", ".hydra", "tensorboard", "references"}


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
        return f"incomplete ({status})" if status == "interrupted" else str(status)

    def scalars(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / SCALARS)

    def modules(self, columns: Optional[Sequence[str]] = None) -> pd.DataFrame:
        return pd.read_parquet(
            self.path / MODULES, columns=list(columns) if columns else None
        )

    def records(self) -> RunRecords:
        """The run's records as signatures read them: scalars, modules, the constants of
        summary.json (null read as NaN, "inf" as inf), and the reference runs it made, from their folders."""
        constants = self.summary.get("constants") or {}
        references = {}
        for name, entry in (self.summary.get("references") or {}).items():
            folder = self.path / str(entry.get("run_dir", f"references/{name}"))
            references[name] = read_run(folder).records()
        return RunRecords(self.scalars(), self.modules(), {k: json_number(v) for k, v in constants.items()},
                          references)


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


def _read_yaml(path: Path) -> Any:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def read_run(run_dir: Path) -> Run:
    """Read one run folder. Raises ``ValueError`` with the reason when it cannot be used."""
    run_dir = Path(run_dir)
    summary_path = run_dir / SUMMARY
    notes = []
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"{SUMMARY} is unreadable ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(summary, dict) or "experiment" not in summary:
            raise ValueError(f"{SUMMARY} has no 'experiment' entry (not a gradrepro run?)")
        overrides = parse_overrides(summary.get("overrides") or [])
    else:
        # Killed before the end: Hydra's own record of the job says what it was.
        try:
            cfg = _read_yaml(run_dir / HYDRA_CONFIG)
            listed = (
                _read_yaml(run_dir / HYDRA_OVERRIDES)
                if (run_dir / HYDRA_OVERRIDES).exists()
                else []
            )
        except Exception as exc:
            raise ValueError(
                f"no {SUMMARY}, and .hydra/config.yaml is unreadable ({type(exc).__name__})"
            ) from None
        summary = {
            "experiment": cfg.get("name"),
            "control": cfg.get("control"),
            "seed": cfg.get("seed"),
            "status": None,
        }
        overrides = parse_overrides(listed or [])
        notes.append(f"no {SUMMARY} (killed mid-way?): listed as incomplete")
    complete = summary.get("status") not in (None, "interrupted")
    run = Run(run_dir, summary, overrides, complete, notes=notes)
    try:
        scalars = pd.read_parquet(run_dir / SCALARS)
        if "loss" in scalars:
            losses = scalars["loss"].dropna()
            run.final_loss = float(losses.iloc[-1]) if len(losses) else math.nan
    except FileNotFoundError:
        run.notes.append(f"no {SCALARS}: final loss and curves left out")
    except Exception as exc:
        run.notes.append(
            f"{SCALARS} is unreadable ({type(exc).__name__}): final loss and curves left out"
        )
    return run


def load_runs(paths: Sequence[Path]) -> Tuple[List[Run], List[str]]:
    """Every readable run under ``paths``; one warning per folder skipped or partly read."""
    runs, warnings = [], []
    seen = set()
    for path in map(Path, paths):
        if not path.exists():
            warnings.append(f"{path}: does not exist")
            continue
        dirs = find_run_dirs(path)
        if not dirs:
            warnings.append(
                f"{path}: no runs found (no {SUMMARY}, .hydra/ or "
                f"{SCALARS} at or below it)"
            )
        for run_dir in dirs:
            key = run_dir.resolve()
            if key in seen:
                continue
            seen.add(key)
            try:
                run = read_run(run_dir)
            except ValueError as exc:
                warnings.append(f"{run_dir}: skipped: {exc}")
                continue
            warnings.extend(f"{run_dir}: {note}" for note in run.notes)
            runs.append(run)
    return runs, warnings


def signature_of(run: Run) -> Optional[Dict[str, Any]]:
    """The run's signature (checks with their params), resolved from ``.hydra/config.yaml``."""
    register_resolvers()  # thresholds written as ${calc:'...'}
    try:
        cfg = OmegaConf.load(run.path / HYDRA_CONFIG)
        return OmegaConf.to_container(cfg.signature, resolve=True)
    except Exception:
        return None
