"""Reference runs: other experiments a run makes itself (config ``references``), with the
same seed, scale, device, threads and step budget, and the command-line overrides both
experiments share (data, model, the fp16 path), into ``run_dir/references/NAME``, so that
a check ``relative_to: NAME`` ("final loss at least 2x fp32's") still reads only what this
run recorded.

A control makes the references its failures' checks name, so that it answers those checks
with runs of its own. Where that reference is the control's own experiment, a run with the
same seed would be a bit-identical copy (a ratio of 1, a distance of 0: no measurement), so
it is an independent **replicate**: the same config with another seed (``replicate_seed``),
and the check then reads what the run's own seed-to-seed noise gives.

The runs are made by the pipeline's own ``run_experiment`` and ``compose``, which the run
hands down in its ``RunContext``: this layer never imports the layers above it."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from gradrepro.errors import first_line
from gradrepro.measure.base import Measurement, RunContext, measurement
from gradrepro.records.reader import read_run
from gradrepro.records.run import RunRecords

log = logging.getLogger(__name__)

# What a reference run shares with the run that asked for it: what makes two runs
# comparable (seed, device, threads, step budget, scale), not the knob under study.
REFERENCE_CARRY = ("seed", "device", "threads", "train.steps")
REFERENCE_MARK = "+_reference_of"
# A replicate's seed: this far from the run's own, so no seed a sweep lists beside it is reused.
REPLICATE_SEED_OFFSET = 1_000_003

TrainFn = Callable[[DictConfig, Path, Sequence[str]], Dict[str, Any]]
ComposeFn = Callable[[Sequence[str]], DictConfig]


def made_references(cfg: Any) -> Dict[str, str]:
    """The references this run makes: ``references`` without the entries set to null (an
    inherited reference the experiment drops)."""
    return {name: exp for name, exp in (cfg.references or {}).items() if exp is not None}


def is_replicate(cfg: Any, experiment: str) -> bool:
    """Whether a reference to ``experiment`` is a replicate of the run's own experiment."""
    return experiment == cfg.name


def replicate_seed(seed: int) -> int:
    return (int(seed) + REPLICATE_SEED_OFFSET) % 2**32


def is_reference(overrides: Sequence[str]) -> bool:
    """Whether these are a reference run's overrides (a reference makes no references)."""
    return any(o.startswith(REFERENCE_MARK) for o in overrides)


def reference_overrides(cfg: DictConfig, overrides: Sequence[str], experiment: str,
                        compose: Optional[ComposeFn] = None) -> list:
    """The overrides a reference run is composed from: its experiment, and what it shares
    with the run that asks for it (``compose`` composes the two experiments to find that;
    without command-line overrides it is not needed)."""
    carried = [f"{key}={OmegaConf.select(cfg, key)}" for key in REFERENCE_CARRY]
    if is_replicate(cfg, experiment):
        carried[0] = f"seed={replicate_seed(cfg.seed)}"
    scale = [o for o in overrides if o.startswith("scale=")]
    own = next((o.partition("=")[2] for o in overrides if o.startswith("experiment=")), None)
    shared = shared_overrides(overrides, own, experiment, compose) if own and compose else []
    return [f"experiment={experiment}", *carried, *scale, *shared]


@dataclass
class References:
    """The reference runs a run made: their records by name, the essentials of each summary,
    and why they stopped short (``failed``: a reference that failed; None when they all ran)."""

    records: Dict[str, RunRecords] = field(default_factory=dict)
    runs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    failed: Optional[str] = None


@measurement
class ReferenceRuns(Measurement):
    """``references: {NAME: EXPERIMENT}``: after a completed run that is not itself a reference
    and was not stopped, each reference experiment is run into ``references/NAME``."""

    name = "reference_runs"
    switch = "references: {NAME: EXPERIMENT}"

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return bool(made_references(cfg))

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.made = References()

    def after_training(self, completed: bool) -> Dict[str, float]:
        c = self.ctx
        if completed and not c.stopped() and not is_reference(c.overrides):
            self.made = run_references(c.cfg, c.run_dir, c.overrides, c.run_experiment, c.compose)
        return {}

    def reference_records(self) -> Dict[str, RunRecords]:
        return self.made.records

    def summary_fields(self) -> Dict[str, Any]:
        return {"references": self.made.runs}

    def failure(self) -> Optional[str]:
        return self.made.failed


def run_references(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], train: TrainFn,
                   compose: ComposeFn) -> References:
    """Run each reference experiment with ``train`` (the pipeline's ``run``). A reference that
    is interrupted (the signal also reaches the run that asked for it) or fails ends the
    series: no verdict is ever computed against a cut-short reference, so its records are
    left out of ``records`` (its folder and summary stay)."""
    out = References()
    for name, experiment in made_references(cfg).items():
        ref_overrides = reference_overrides(cfg, overrides, experiment, compose)
        ref_dir = run_dir / "references" / name
        log.info("reference %s: experiment=%s", name, experiment)
        try:
            ref_cfg = compose(ref_overrides)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train(ref_cfg, ref_dir, [*ref_overrides, f"{REFERENCE_MARK}={cfg.name}"])
        except Exception as exc:  # noqa: BLE001 - said in the run's summary, never a verdict
            out.failed = f"reference run {name} (experiment={experiment}) failed: {first_line(exc)}"
            out.runs[name] = {"experiment": experiment, "overrides": ref_overrides, "status": "failed",
                              "run_dir": f"references/{name}"}
            break
        out.runs[name] = {"experiment": experiment, "overrides": ref_overrides,
                          "status": summary["status"], "wall_s": summary.get("wall_s"),
                          "run_dir": f"references/{name}", "seed": summary.get("seed"),
                          "replicate": is_replicate(cfg, experiment)}
        if summary["status"] == "interrupted":
            break
        ref = read_run(ref_dir)
        out.records[name] = ref.records(references=False)
    return out


def shared_overrides(overrides: Sequence[str], experiment: str, reference: str, compose: ComposeFn) -> List[str]:
    """The run's command-line overrides its reference takes too: those whose key the two
    experiments set alike (the data, the model, the fp16 path where both compute in fp16), so
    that the two runs stay comparable. A key the experiments set differently is the knob under
    study and stays the reference's own (an fp32 reference stays fp32 under precision.mode=fp16)."""
    own, ref = compose([f"experiment={experiment}"]), compose([f"experiment={reference}"])
    out = []
    for override in overrides:
        key, sep, _ = override.partition("=")
        key = key.lstrip("+")
        if not sep or key in REFERENCE_CARRY or key.startswith(("~", "hydra", "experiment", "scale", "_reference")):
            continue
        if OmegaConf.select(own, key) == OmegaConf.select(ref, key):  # a group: its whole node
            out.append(override)
    return out
