"""How a run ends on disk, whatever ends it: summary.json says what happened.

A full disk at the final write costs as little as it can: each record file is written on its
own (one that fails keeps its last complete version), the summary says which are missing, and
a summary that does not fit is written again smaller (then minimal). Where not even that can
be written, ``RecordsIncomplete`` carries the one line the command prints. A run that ends by
an exception or a signal before its summary exists gets a summary too (``stub_summary``).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from gradrepro.errors import first_line
from gradrepro.records.files import SUMMARY, write_json
from gradrepro.records.provenance import versions
from gradrepro.records.untrusted import one_line
from gradrepro.records.writer import Records
from gradrepro.signature import Verdict

# What the compact summary keeps when the full one does not fit: the contract's fields that
# say what the run was and how it ended, and each check without its params and paper text.
_COMPACT = ("experiment", "control", "reproduced", "status", "signal", "error", "stopped_at", "steps",
            "wall_s", "seed", "overrides", "device", "missing")
_CHECK_CORE = ("metric", "observed", "op", "threshold", "ok", "role")
_MINIMAL = ("experiment", "status", "signal", "error", "steps", "seed", "missing")


class RecordsIncomplete(Exception):
    """summary.json could not be written at all: the one line to print, with the folder."""

    def __init__(self, run_dir: Path, reason: str) -> None:
        super().__init__(f"the records in {str(run_dir)!r} are incomplete: {reason}")
        self.run_dir = Path(run_dir)


def _compact(summary: Dict[str, Any]) -> Dict[str, Any]:
    small = {k: summary[k] for k in _COMPACT if k in summary}
    small["checks"] = [{k: c.get(k) for k in _CHECK_CORE} for c in summary.get("checks") or []]
    return small


def write_summary(run_dir: Path, summary: Dict[str, Any]) -> Dict[str, Any]:
    """Write ``summary``; on an OS error (a full disk), a compact one, then a minimal one, each
    saying in ``missing`` what it leaves out. Returns what was written; RecordsIncomplete if
    nothing could be."""
    attempts = [("", summary), ("summary.json: written compact (constants, references, paper, "
                                "versions and the checks' params left out)", _compact(summary)),
                ("summary.json: written minimal (only the run's name, status and what is missing)",
                 {k: summary[k] for k in _MINIMAL if k in summary})]
    error: Optional[OSError] = None
    for note, attempt in attempts:
        if note:
            attempt = {**attempt, "missing": [*summary.get("missing", []),
                                              f"{note}: the full one could not be written "
                                              f"({error.strerror or error})"]}
        try:
            write_json(Path(run_dir) / SUMMARY, attempt)
            return attempt
        except OSError as exc:
            error = exc
    missing = "; ".join(summary.get("missing", [])) or "the other record files were written"
    raise RecordsIncomplete(run_dir, f"{SUMMARY} could not be written ({error.strerror or error}); "
                                     f"{one_line(missing, 300)}")


def stub_summary(cfg: Any, overrides: Sequence[str], status: str, start: float,
                 error: Optional[BaseException] = None, signum: Optional[int] = None,
                 steps: int = 0, stopped_at: Optional[int] = None,
                 missing: Sequence[str] = ()) -> Dict[str, Any]:
    """The summary of a run that ended before it could make its own (a config only the run
    could refuse, a signal during set-up, an exception outside the training steps)."""
    summary: Dict[str, Any] = {
        "experiment": str(OmegaConf.select(cfg, "name", default="unnamed")),
        "control": OmegaConf.select(cfg, "control", default=None),
        "claim": str(OmegaConf.select(cfg, "claim", default="")),
        "claim_kind": OmegaConf.select(cfg, "claim_kind", default=None),
        "reproduced": None,
        "checks": [],
        "status": status,
        "stopped_at": stopped_at,
        "steps": steps,
        "wall_s": round(time.perf_counter() - start, 3),
        "seed": OmegaConf.select(cfg, "seed", default=None),
        "overrides": list(overrides),
        "versions": versions(),
    }
    if signum is not None:
        summary["signal"] = signal.Signals(signum).name
    if error is not None:
        summary["error"] = one_line(f"{type(error).__name__}: {error}", 2000)
    if missing:
        summary["missing"] = list(missing)
    return summary


class RunState:
    """What a run has made so far, so that whatever ends it can still write it down."""

    def __init__(self, cfg: DictConfig, run_dir: Path, overrides: Sequence[str], start: float) -> None:
        self.cfg, self.run_dir, self.overrides, self.start = cfg, run_dir, list(overrides), start
        self.records: Optional[Records] = None
        self.outcome: Optional[Outcome] = None
        self.summary: Optional[Dict[str, Any]] = None  # the last one written

    def write(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        self.summary = write_summary(self.run_dir, summary)
        return self.summary

    def interrupted(self, signum: int) -> Dict[str, Any]:
        """The summary written, now saying that a signal ended the run (no verdict)."""
        return self.write({**self.summary, "status": "interrupted", "reproduced": None,
                           "signal": signal.Signals(signum).name})

    def salvage(self, status: str, signum: Optional[int], error: Optional[BaseException] = None) -> Dict[str, Any]:
        """Write the records kept in memory and a summary saying how the run ended."""
        missing: list = []
        if self.records is not None:
            missing = self.records.write_all()
            with contextlib.suppress(Exception):
                self.records.close()
        done = self.outcome.step if self.outcome is not None else 0
        summary = stub_summary(self.cfg, self.overrides, status, self.start, error, signum,
                               steps=done, stopped_at=done - 1 if done else None, missing=missing)
        return self.write(summary)


@dataclass
class Outcome:
    """How the training steps ended."""

    status: str = "completed"  # completed | diverged | interrupted | failed | device_mismatch
    stopped_at: Optional[int] = None
    step: int = 0
    skipped: int = 0  # optimizer steps the loss scaler skipped
    error: Optional[BaseException] = None

    def stop(self, status: str, error: Optional[BaseException] = None) -> None:
        """After the steps: ``interrupted`` or ``failed`` (the first cause is kept)."""
        if self.status in ("completed", "diverged"):
            self.status, self.error = status, error
            if self.stopped_at is None and self.step:
                self.stopped_at = self.step - 1


def full_summary(cfg: Any, t: Any, outcome: Outcome, verdict: Verdict, constants: Dict[str, Any],
                 measured: Dict[str, Any], device: torch.device, state: RunState,
                 signal_name: Optional[str], missing: Sequence[str]) -> Dict[str, Any]:
    """summary.json of a run that reached its verdict (the run folder contract in README.md);
    ``measured``: what the measurements add besides constants (``references``: the reference
    runs' essentials)."""
    completed = outcome.status == "completed"
    summary = {
        "experiment": cfg.name,
        "control": cfg.control,
        "claim": cfg.claim,
        "claim_kind": cfg.claim_kind,
        # A verdict needs the whole run (and whole reference runs): none for an interrupted one.
        "reproduced": verdict.reproduced if outcome.status != "interrupted" else None,
        "checks": verdict.as_dicts(),
        # The signature as this run resolved it: what compare evaluates on other runs (a run
        # folder's config is never resolved again when it is read).
        "signature": OmegaConf.to_container(cfg.signature, resolve=True),
        "paper": OmegaConf.to_container(cfg.paper, resolve=True),
        "status": outcome.status,
        "stopped_at": outcome.stopped_at,
        "steps": outcome.step if completed else (0 if outcome.stopped_at is None else outcome.stopped_at + 1),
        "wall_s": round(time.perf_counter() - state.start, 3),
        "seed": cfg.seed,
        "overrides": list(state.overrides),
        "constants": constants,
        "references": {},
        "frozen": t.frozen,
        "eval_modules": t.held,
        "versions": versions(),
        "device": f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device),
        "threads": cfg.threads,
    }
    summary.update(measured)
    if outcome.status == "interrupted":
        summary["signal"] = signal_name or "SIGINT"
    if outcome.error is not None:
        summary["error"] = first_line(f"{type(outcome.error).__name__}: {outcome.error}")
    if missing:
        summary["missing"] = list(missing)
    if getattr(t, "device_mismatch", None) is not None:
        summary["device_mismatch"] = t.device_mismatch.as_dict()
    return summary
