"""The one training loop every experiment passes through.

    forward -> objective -> backward -> probe.collect -> optimizer.step -> probe columns

An experiment changes the graph or the numeric regime through config (a flag on an
objective, an init scheme, a precision mode, a frozen module), never through a copy of
this loop. The verdict is computed afterwards from the records alone (gradrepro/signature).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from gradrepro.analysis.run_figure import checked_scalars, plot_signals
from gradrepro.config.validate import validate
from gradrepro.errors import UserError, first_line
from gradrepro.measure.frozen_audit import FrozenAudit
from gradrepro.measure.init_reference import measure_reference
from gradrepro.measure.mode_pass import mode_pass
from gradrepro.measure.reference_runs import References, is_reference, run_references
from gradrepro.measure.shadow_fp32 import ShadowFP32
from gradrepro.probe.probe import step_norms
from gradrepro.records import open_records
from gradrepro.records.claim import holding
from gradrepro.records.files import FIGURE, MODULES, SCALARS, SUMMARY, ensure_writable_dir
from gradrepro.records.run import RunRecords
from gradrepro.records.writer import Records
from gradrepro.signature import evaluate, format_verdict
from gradrepro.train.build import Training, build_training
from gradrepro.train.finish import Outcome, RunState, full_summary
from gradrepro.train.footprint import check_footprint
from gradrepro.train.mode_policy import hold_eval
from gradrepro.train.session import (
    SafeBar,
    StopRequest,
    flush_seconds,
    resolve_device,
    seed_everything,
)

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Train as ``cfg`` says, write the run directory, return the summary.

    The folder is claimed first (``records/claim.py``): one that another run holds or that
    already holds a run is refused. Whatever then ends the run (the last step, a non-finite
    loss or gradient, SIGINT/SIGTERM at any point, an exception), the records so far are
    written and ``summary.json`` says which it was (``status``); an exception is re-raised
    after that, a signal is a result (``status: interrupted``).
    """
    validate(cfg)
    run_dir = Path(run_dir)
    start = time.perf_counter()
    # Hydra's own record of this job (.hydra/) is already there; another run's records are not.
    with holding(run_dir, markers=(SUMMARY, SCALARS, MODULES)):
        ensure_writable_dir(run_dir)  # before any work: a read-only or full disk is one line
        with StopRequest() as stop:
            state = RunState(cfg, run_dir, overrides, start)
            try:
                return _run(cfg, run_dir, overrides, stop, state)
            except KeyboardInterrupt:  # a second signal outside the steps: stop now, say so
                if state.summary is not None:
                    return state.interrupted(stop.signal or signal.SIGINT)
                return state.salvage("interrupted", stop.signal or signal.SIGINT)
            except BaseException as exc:
                if state.summary is None:
                    state.salvage("failed", None, exc)
                raise


def _run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], stop: StopRequest,
         state: RunState) -> Dict[str, Any]:
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    check_footprint(cfg)  # a config larger than the free memory: one line, not a killed process
    seed_everything(cfg.seed, device)
    t = build_training(cfg, device)
    audit = FrozenAudit(t.net, t.frozen, t.data.eval_sets()[2][:256]) if t.frozen else None
    records = state.records = open_records(cfg.logger, run_dir, t.net)  # logger=tensorboard also writes there
    generator = torch.Generator().manual_seed(cfg.seed)

    def evaluate_at(step: int) -> None:
        records.add_scalars({"step": step, **t.objective.evaluate(t.net, t.data, knn_k=cfg.eval.knn_k)})
        hold_eval(t.net, t.held)  # evaluate's net.train() put every module back in train mode

    if t.device_mismatch is not None:  # the first forward pass cannot run: nothing trains
        outcome = state.outcome = Outcome(status="device_mismatch")
        constants = _evaluate_unmoved(evaluate_at)
    else:
        constants = _initial_constants(cfg, t, records, generator, device, evaluate_at)
        shadow = (ShadowFP32(t.probe.hooked, cfg.precision.mode, cfg.probe.act_sample)
                  if cfg.probe.act_grad_reference else None)
        outcome = state.outcome = _train_steps(cfg, t, records, generator, stop, evaluate_at, shadow)
        _after_steps(cfg, t, outcome, stop, evaluate_at)
    # An interrupted run stops quickly: the records up to the signal are what the user asked
    # to keep. A diverged or failed run is evaluated on what exists.
    missing = records.write_all()
    records.close()
    if audit is not None:
        constants.update(audit.finish(t.net))
    if cfg.eval.mode_pass.mode is not None and outcome.status == "completed":
        constants.update(mode_pass(t.net, t.objective, t.data, cfg.eval.mode_pass, t.held))
    scalars, modules = records.scalars(), records.modules()
    refs = References()
    if outcome.status == "completed" and stop.signal is None and cfg.references and not is_reference(overrides):
        refs = run_references(cfg, run_dir, overrides, train=run)
        if refs.failed:
            outcome.stop("failed", RuntimeError(refs.failed))
    if stop.signal is not None:  # during the final evaluation, the mode pass or a reference run
        outcome.stop("interrupted")
    verdict = evaluate(cfg.signature, RunRecords(scalars, modules, constants, refs.records))
    summary = state.write(full_summary(cfg, t, outcome, verdict, constants, refs.runs, device, state,
                                       stop.name, missing))
    if outcome.error is not None and not refs.failed:
        raise outcome.error
    cut = _draw_figure(cfg, scalars, modules, run_dir, outcome.status)
    if (cut or stop.signal is not None) and outcome.status in ("completed", "diverged"):
        outcome.stop("interrupted")  # a signal while the figure was drawn: said, not ignored
        summary = state.interrupted(stop.signal or signal.SIGINT)
    if outcome.status == "interrupted":
        print(f"{cfg.name}: interrupted ({summary.get('signal')}); no verdict")
    else:
        print(format_verdict(verdict, cfg.name))
    if t.device_mismatch is not None:
        m = t.device_mismatch
        print(f"device mismatch at the first forward pass: {', '.join(m.tensors)} stayed on "
              f"{', '.join(sorted(set(m.held_on)))} while the parameters are on {m.device} ({m.error})")
    print(f"status: {outcome.status}; run directory: {run_dir}")
    return summary


def _initial_constants(cfg: DictConfig, t: Training, records: Records, generator: torch.Generator,
                       device: torch.device, evaluate_at: Callable[[int], None]) -> Dict[str, Any]:
    """The evaluation before any step (its values as ``*_init`` constants), the held-out size,
    and the init reference where the experiment asks for it."""
    try:
        evaluate_at(0)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:  # before any step: the config
        raise UserError(f"the evaluation before training failed (objective={cfg.objective.name}, "
                        f"model={cfg.model.name}): {first_line(exc)}") from None
    constants = {f"{k}_init": v for k, v in records.scalar_rows[0].items() if k != "step"}
    constants["n_test"] = len(t.data.eval_sets()[3])  # held-out examples every evaluation uses
    if cfg.init.reference:
        constants.update(measure_reference(cfg, t.data, t.objective, t.init_rng, generator, device))
    return constants


def _evaluate_unmoved(evaluate_at: Callable[[int], None]) -> Dict[str, Any]:
    """The evaluation of a run whose first forward pass failed on unmoved tensors: what the
    objective can still say about the model (the missing_grad objective: its registration
    findings); an objective that needs a forward pass records nothing."""
    try:
        evaluate_at(0)
    except RuntimeError as exc:
        log.warning("no evaluation: the forward pass fails (%s)", first_line(exc))
    return {"device_mismatch": 1.0}


def _after_steps(cfg: DictConfig, t: Training, outcome: Outcome, stop: StopRequest,
                 evaluate_at: Callable[[int], None]) -> None:
    """The final evaluation of a run whose steps all ran, unless a signal came first."""
    if stop.signal is not None:
        outcome.stop("interrupted")
    if outcome.status != "completed" or cfg.train.steps <= 0:
        return
    try:
        evaluate_at(cfg.train.steps)
    except Exception as exc:  # noqa: BLE001 - a bug: keep what was recorded, then re-raise
        outcome.stop("failed", exc)


def _draw_figure(cfg: DictConfig, scalars, modules, run_dir: Path, status: str) -> bool:
    """signals.png; a failure costs nothing but the figure. True if a second signal cut it."""
    try:
        checks = OmegaConf.to_container(cfg.signature.checks, resolve=True)
        plot_signals(scalars, modules, run_dir / FIGURE, f"{cfg.name} (seed {cfg.seed}, {status})",
                     cfg.key_scalar, checked_scalars(checks, list(scalars.columns)))
    except KeyboardInterrupt:
        log.warning("%s not drawn: interrupted", FIGURE)
        return True
    except Exception as exc:  # noqa: BLE001 - a figure never costs the records
        log.warning("could not draw %s: %s", FIGURE, exc)
    return False


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
           "scale_growths": t.precision.growths, "scale_backoffs": t.precision.backoffs, **step_norms(columns)}
    row.update({k: float(v) for k, v in out.scalars.items()})
    records.add_scalars(row)
    nonfinite_grads = bool((columns["grad_state"] == "nonfinite").any())
    bar.set_postfix(loss=f"{loss_value:.4f}", **(
        {cfg.key_scalar: f"{row[cfg.key_scalar]:.4g}"} if cfg.key_scalar in row else {}))
    return True, diverged or (nonfinite_grads and not t.precision.skips_nonfinite)


def flush_or_warn(records: Records) -> None:
    """A periodic flush that fails (a full disk) warns and keeps the records in memory for
    the final write; training goes on."""
    try:
        records.flush()
    except OSError as exc:
        log.warning("could not write the records yet (%s); will try again at the end", exc)
