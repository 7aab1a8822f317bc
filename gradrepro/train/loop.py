"""The one training loop every experiment passes through.

    forward -> objective -> backward -> probe.collect -> optimizer.step -> probe columns

An experiment changes the graph or the numeric regime through config (a flag on an
objective, an init scheme, a precision mode, a frozen module), never through a copy of
this loop. The verdict is computed afterwards from the records alone (gradrepro/signature).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from gradrepro.analysis.run_figure import plot_signals
from gradrepro.config.validate import validate
from gradrepro.measure.frozen_audit import FrozenAudit
from gradrepro.measure.init_reference import measure_reference
from gradrepro.measure.mode_pass import mode_pass
from gradrepro.measure.reference_runs import is_reference, run_references
from gradrepro.measure.shadow_fp32 import ShadowFP32
from gradrepro.records import open_records
from gradrepro.records.files import FIGURE, SUMMARY, ensure_writable_dir, write_json
from gradrepro.records.run import RunRecords
from gradrepro.records.writer import Records
from gradrepro.signature import Verdict, evaluate, format_verdict
from gradrepro.train.build import Training, build_training
from gradrepro.train.mode_policy import hold_eval
from gradrepro.train.session import (
    SafeBar,
    StopRequest,
    flush_seconds,
    resolve_device,
    seed_everything,
    versions,
)

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Train as ``cfg`` says, write the run directory, return the summary.

    Whatever ends the run (the last step, a non-finite loss or gradient, SIGINT/SIGTERM, an
    exception), the records so far are written and ``summary.json`` says which it was
    (``status``); an exception is re-raised after that.
    """
    validate(cfg)
    run_dir = Path(run_dir)
    ensure_writable_dir(run_dir)  # before any work: a read-only or full disk is one line
    with StopRequest() as stop:
        return _run(cfg, run_dir, overrides, stop)


@dataclass
class Outcome:
    """How the training steps ended."""

    status: str = "completed"  # completed | diverged | interrupted | failed | device_mismatch
    stopped_at: Optional[int] = None
    step: int = 0
    skipped: int = 0  # optimizer steps the loss scaler skipped
    error: Optional[BaseException] = None


def _run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], stop: StopRequest) -> Dict[str, Any]:
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed, device)
    start = time.perf_counter()
    t = build_training(cfg, device)
    audit = FrozenAudit(t.net, t.frozen, t.data.eval_sets()[2][:256]) if t.frozen else None
    records = open_records(cfg.logger, run_dir, t.net)  # logger=tensorboard also writes there
    generator = torch.Generator().manual_seed(cfg.seed)

    def evaluate_at(step: int) -> None:
        records.add_scalars({"step": step, **t.objective.evaluate(t.net, t.data, knn_k=cfg.eval.knn_k)})
        hold_eval(t.net, t.held)  # evaluate's net.train() put every module back in train mode

    if t.device_mismatch is not None:  # the first forward pass cannot run: nothing trains
        outcome, constants = Outcome(status="device_mismatch"), _evaluate_unmoved(records, evaluate_at)
    else:
        evaluate_at(0)
        constants = {f"{k}_init": v for k, v in records.scalar_rows[0].items() if k != "step"}
        constants["n_test"] = len(t.data.eval_sets()[3])  # held-out examples every evaluation uses
        if cfg.init.reference:
            constants.update(measure_reference(cfg, t.data, t.objective, t.init_rng, generator, device))
        shadow = (ShadowFP32(t.probe.hooked, cfg.precision.mode, cfg.probe.act_sample)
                  if cfg.probe.act_grad_reference else None)
        outcome = _train_steps(cfg, t, records, generator, stop, evaluate_at, shadow)
    if outcome.status == "completed" and cfg.train.steps > 0:
        evaluate_at(cfg.train.steps)
    # An interrupted run stops quickly: the records up to the signal are what the user asked
    # to keep. A diverged or failed run is evaluated on what exists.
    records.flush()
    records.close()
    if audit is not None:
        constants.update(audit.finish(t.net))
    if cfg.eval.mode_pass.mode is not None and outcome.status == "completed":
        constants.update(mode_pass(t.net, t.objective, t.data, cfg.eval.mode_pass, t.held))

    scalars, modules = records.scalars(), records.modules()
    references, reference_runs = {}, {}
    if outcome.status == "completed" and cfg.references and not is_reference(overrides):
        references, reference_runs = run_references(cfg, run_dir, overrides, train=run)
    verdict = evaluate(cfg.signature, RunRecords(scalars, modules, constants, references))
    summary = _summary(cfg, t, outcome, verdict, constants, reference_runs, overrides, device, start)
    if outcome.status == "interrupted":
        summary["signal"] = stop.name or "SIGINT"
    if outcome.error is not None:
        summary["error"] = f"{type(outcome.error).__name__}: {outcome.error}"
    if t.device_mismatch is not None:
        summary["device_mismatch"] = t.device_mismatch.as_dict()
    write_json(run_dir / SUMMARY, summary)
    if outcome.error is not None:
        raise outcome.error
    try:
        plot_signals(scalars, modules, run_dir / FIGURE, f"{cfg.name} (seed {cfg.seed}, {outcome.status})",
                     cfg.key_scalar)
    except Exception as exc:  # noqa: BLE001 - a figure never costs the records
        log.warning("could not draw %s: %s", FIGURE, exc)
    print(format_verdict(verdict, cfg.name))
    if t.device_mismatch is not None:
        m = t.device_mismatch
        print(f"device mismatch at the first forward pass: {', '.join(m.tensors)} stayed on "
              f"{', '.join(sorted(set(m.held_on)))} while the parameters are on {m.device} ({m.error})")
    print(f"status: {outcome.status}; run directory: {run_dir}")
    return summary


def _evaluate_unmoved(records: Records, evaluate_at: Callable[[int], None]) -> Dict[str, Any]:
    """The evaluation of a run whose first forward pass failed on unmoved tensors: what the
    objective can still say about the model (the missing_grad objective: its registration
    findings); an objective that needs a forward pass records nothing."""
    try:
        evaluate_at(0)
    except RuntimeError as exc:
        log.warning("no evaluation: the forward pass fails (%s)", str(exc).splitlines()[0] if str(exc) else exc)
    return {"device_mismatch": 1.0}


def _train_steps(cfg: DictConfig, t: Training, records: Records, generator: torch.Generator,
                 stop: StopRequest, evaluate_at: Callable[[int], None], shadow: Optional[ShadowFP32]) -> Outcome:
    """The training steps, until the last one, a divergence, a signal or an exception."""
    steps = cfg.train.steps
    outcome = Outcome()
    last_flush, period = None, flush_seconds()  # first flush right after the first logged step
    bar = SafeBar(steps, cfg.name)
    step = 0
    try:
        for step in range(steps):
            if stop.signal is not None:  # a signal that came before this step (during setup)
                outcome.status, outcome.stopped_at = "interrupted", (step - 1 if step else None)
                break
            logged, diverged = _step(cfg, t, records, generator, step, outcome, bar, shadow)
            bar.update(1)
            if diverged:
                outcome.status, outcome.stopped_at = "diverged", step
                break
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < steps:
                evaluate_at(step + 1)
            if stop.signal is not None:
                outcome.status, outcome.stopped_at = "interrupted", step
                break
            if logged and (last_flush is None or time.monotonic() - last_flush > period):
                flush_or_warn(records)
                last_flush = time.monotonic()
        else:
            step = steps
    except KeyboardInterrupt:  # a second signal, or Ctrl-C where no handler could be set
        outcome.status, outcome.stopped_at = "interrupted", step
    except Exception as exc:  # noqa: BLE001 - a bug: keep what was recorded, then re-raise
        outcome.status, outcome.stopped_at, outcome.error = "failed", step, exc
    bar.close()
    outcome.step = step
    return outcome


def _step(cfg: DictConfig, t: Training, records: Records, generator: torch.Generator, step: int,
          outcome: Outcome, bar: SafeBar, shadow: Optional[ShadowFP32] = None) -> tuple[bool, bool]:
    """One training step; returns (logged, diverged)."""
    batch = t.data.sample(generator)
    if cfg.train.zero_grad:
        t.optimizer.zero_grad(set_to_none=True)
    scale = t.precision.loss_scale  # of this step's backward (a dynamic scale moves at the step)
    with t.probe.step(step, lr=t.optimizer.param_groups[0]["lr"], loss_scale=scale) as p:
        shadowed = shadow is not None and p.logged
        if shadowed:
            shadow.arm()
        with t.precision.autocast():
            out = t.objective(t.net, batch)
        loss_value = float(out.loss.detach())
        diverged = not math.isfinite(loss_value)
        if diverged:
            p.log_anyway()  # record the step where it broke
        contribute = p.logged and cfg.probe.task_contribution and len(out.terms) > 1
        t.precision.backward(out.loss, retain_graph=contribute)
        if shadowed:
            shadow.disarm()
        if contribute:
            p.contribution(out.terms)
        t.precision.unscale(t.optimizer)
        p.collect()
        if shadowed:  # the same weights (before the step), outside autocast: fp32
            shadow.compare(t.objective, t.net, batch, t.precision.shift, scale)
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(t.net.parameters(), cfg.train.grad_clip)
        if not diverged:
            outcome.skipped += not t.precision.step(t.optimizer)
            t.scheduler.step()
    if not p.logged:
        return False, diverged
    columns = p.columns
    if shadowed:
        columns.update(shadow.columns(t.probe.module_of))
    records.add_modules(columns)
    row = {"step": step, "loss": loss_value, "lr": t.scheduler.get_last_lr()[0],
           "loss_scale": t.precision.loss_scale, "skipped_steps": outcome.skipped,
           "scale_growths": t.precision.growths, "scale_backoffs": t.precision.backoffs,
           "grad_norm": total_grad_norm(columns),
           "fresh_grad_norm": float(np.sqrt(np.nansum(columns["fresh_grad_norm"] ** 2)))}
    row.update({k: float(v) for k, v in out.scalars.items()})
    records.add_scalars(row)
    nonfinite_grads = bool((columns["grad_state"] == "nonfinite").any())
    bar.set_postfix(loss=f"{loss_value:.4f}", **(
        {cfg.key_scalar: f"{row[cfg.key_scalar]:.4g}"} if cfg.key_scalar in row else {}))
    return True, diverged or (nonfinite_grads and not t.precision.skips_nonfinite)


def _summary(cfg: DictConfig, t: Training, outcome: Outcome, verdict: Verdict, constants: Dict[str, Any],
             reference_runs: Dict[str, Any], overrides: Sequence[str], device: torch.device,
             start: float) -> Dict[str, Any]:
    """summary.json (the run directory contract in README.md)."""
    completed = outcome.status == "completed"
    return {
        "experiment": cfg.name,
        "control": cfg.control,
        "claim": cfg.claim,
        "reproduced": verdict.reproduced,
        "checks": verdict.as_dicts(),
        "paper": OmegaConf.to_container(cfg.paper, resolve=True),
        "status": outcome.status,
        "stopped_at": outcome.stopped_at,
        "steps": outcome.step if completed else (0 if outcome.stopped_at is None else outcome.stopped_at + 1),
        "wall_s": round(time.perf_counter() - start, 3),
        "seed": cfg.seed,
        "overrides": list(overrides),
        "constants": constants,
        "references": reference_runs,
        "frozen": t.frozen,
        "eval_modules": t.held,
        "versions": versions(),
        "device": f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device),
        "threads": cfg.threads,
    }


def total_grad_norm(columns: Dict[str, np.ndarray]) -> float:
    """The whole model's gradient norm: tensors without a gradient (``none``) are left out,
    a non-finite one makes the total non-finite (it is recorded, never dropped)."""
    has_grad = columns["grad_state"] != "none"
    return float(np.sqrt(np.sum(np.asarray(columns["grad_norm"], dtype=float)[has_grad] ** 2)))


def flush_or_warn(records: Records) -> None:
    """A periodic flush that fails (a full disk) warns and keeps the records in memory for
    the final write; training goes on."""
    try:
        records.flush()
    except OSError as exc:
        log.warning("could not write the records yet (%s); will try again at the end", exc)
