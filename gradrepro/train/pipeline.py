"""The experiment pipeline, top to bottom:

    validate -> build -> evaluate at step 0 -> measurements before training -> train (the loop)
    -> final evaluation -> write the records -> measurements after training (reference runs last)
    -> verdict -> summary -> figure -> print

``run(cfg, run_dir)`` is what ``python -m gradrepro`` calls once its config is composed, and
what tests call in-process. The loop itself is ``train/loop.py``; what a run measures besides
the probe is asked of the measurements (``gradrepro.measure``); the verdict is a pure function
of the records (``gradrepro.signature``).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from gradrepro.config.compose import compose
from gradrepro.config.validate import validate
from gradrepro.errors import UserError, first_line
from gradrepro.measure import Measurement, RunContext, start_measurements
from gradrepro.recipe.build import Training, build_training
from gradrepro.recipe.footprint import check_footprint
from gradrepro.recipe.mode_policy import hold_eval
from gradrepro.recipe.sharding import rank_and_world
from gradrepro.records import open_records
from gradrepro.records.claim import claimed
from gradrepro.records.figure import checked_scalars, plot_signals
from gradrepro.records.files import FIGURE, MODULES, SCALARS, SUMMARY, ensure_writable_dir
from gradrepro.records.run import RunRecords
from gradrepro.records.writer import Records
from gradrepro.signature import evaluate, format_verdict
from gradrepro.train.distributed import run_processes, starts_processes
from gradrepro.train.finish import Outcome, RunState, full_summary
from gradrepro.train.loop import train_steps
from gradrepro.train.page_note import not_held_note
from gradrepro.train.session import StopRequest, resolve_device, seed_everything

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Train as ``cfg`` says, write the run folder, return the summary.

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
    with claimed(run_dir, markers=(SUMMARY, SCALARS, MODULES)):
        ensure_writable_dir(run_dir)  # before any work: a read-only or full disk is one line
        if starts_processes(cfg):  # distributed.processes > 1: each runs run_claimed, the first into run_dir
            return run_processes(cfg, run_dir, overrides, start)
        return run_claimed(cfg, run_dir, overrides, start)


def run_claimed(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], start: float) -> Dict[str, Any]:
    """The run, in a folder already claimed for it (by this process, or by the process that
    started this one as a process of a distributed run)."""
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
    # Build.
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    check_footprint(cfg)  # a config larger than the free memory: one line, not a killed process
    seed_everything(cfg.seed, device)
    t = build_training(cfg, device)
    records = state.records = open_records(cfg.logger, run_dir, t.net)  # logger=tensorboard also writes there
    generator = torch.Generator().manual_seed(cfg.seed)

    def measure_held_out(step: int) -> None:
        records.add_scalars({"step": step, **t.objective.held_out_metrics(t.net, t.data, knn_k=cfg.eval.knn_k)})
        hold_eval(t.net, t.held)  # evaluate's net.train() put every module back in train mode

    # Train, with the measurements this config switches on.
    measurements: List[Measurement] = []
    if t.device_mismatch is not None:  # the first forward pass cannot run: nothing trains
        outcome = state.outcome = Outcome(status="device_mismatch")
        constants = _evaluate_unmoved(measure_held_out)
    else:
        constants = _initial_constants(cfg, t, records, measure_held_out)
        measurements = start_measurements(RunContext(
            cfg, t, device, generator, run_dir, overrides, run_experiment=run, compose=compose,
            stopped=lambda: stop.signal is not None))
        for m in measurements:
            constants.update(m.before_training())
        outcome = state.outcome = train_steps(cfg, t, records, generator, stop, measure_held_out, measurements)
        _after_steps(cfg, outcome, stop, measure_held_out)
    # An interrupted run stops quickly: the records up to the signal are what the user asked
    # to keep. A diverged or failed run is evaluated on what exists.
    missing = records.write_all()
    records.close()
    for m in measurements:
        constants.update(m.after_training(outcome.status == "completed"))
    failed = next((m.failure() for m in measurements if m.failure()), None)
    if failed:
        outcome.stop("failed", RuntimeError(failed))
    if stop.signal is not None:  # during the final evaluation or a measurement (a reference run)
        outcome.stop("interrupted")

    # Verdict and summary.
    references: Dict[str, RunRecords] = {}
    measured: Dict[str, Any] = {"references": {}}
    for m in measurements:
        references.update(m.reference_records())
        measured.update(m.summary_fields())
    verdict = evaluate(cfg.signature, RunRecords(records.scalars(), records.modules(), constants, references))
    summary = state.write(full_summary(cfg, t, outcome, verdict, constants, measured, device, state,
                                       stop.name, missing))
    if outcome.error is not None and not failed:
        raise outcome.error

    # Figure and print.
    # Process 0 of a distributed run draws the figure; the others' folders are scratch.
    cut = _draw_figure(cfg, records, run_dir, outcome.status) if rank_and_world()[0] == 0 else False
    if (cut or stop.signal is not None) and outcome.status in ("completed", "diverged"):
        outcome.stop("interrupted")  # a signal while the figure was drawn: said, not ignored
        summary = state.interrupted(stop.signal or signal.SIGINT)
    _print_result(cfg, t, verdict, outcome, summary, run_dir)
    return summary


def _initial_constants(cfg: DictConfig, t: Training, records: Records,
                       measure_held_out: Callable[[int], None]) -> Dict[str, Any]:
    """The evaluation before any step (its values as ``*_init`` constants), the held-out size and
    the network's shape facts."""
    try:
        measure_held_out(0)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:  # before any step: the config
        raise UserError(f"the evaluation before training failed (objective={cfg.objective.name}, "
                        f"model={cfg.model.name}): {first_line(exc)}") from None
    constants = {f"{k}_init": v for k, v in records.scalar_rows[0].items() if k != "step"}
    constants["n_test"] = len(t.data.eval_sets()[3])  # held-out examples every evaluation uses
    constants.update(t.shape_facts)
    return constants


def _evaluate_unmoved(measure_held_out: Callable[[int], None]) -> Dict[str, Any]:
    """The evaluation of a run whose first forward pass failed on unmoved tensors: what the
    objective can still say about the model (the missing_grad objective: its registration
    findings); an objective that needs a forward pass records nothing."""
    try:
        measure_held_out(0)
    except RuntimeError as exc:
        log.warning("no evaluation: the forward pass fails (%s)", first_line(exc))
    return {"device_mismatch": 1.0}


def _after_steps(cfg: DictConfig, outcome: Outcome, stop: StopRequest, measure_held_out: Callable[[int], None]) -> None:
    """The final evaluation of a run whose steps all ran, unless a signal came first."""
    if stop.signal is not None:
        outcome.stop("interrupted")
    if outcome.status != "completed" or cfg.train.steps <= 0:
        return
    try:
        measure_held_out(cfg.train.steps)
    except Exception as exc:  # noqa: BLE001 - a bug: keep what was recorded, then re-raise
        outcome.stop("failed", exc)


def _draw_figure(cfg: DictConfig, records: Records, run_dir: Path, status: str) -> bool:
    """signals.png; a failure costs nothing but the figure. True if a second signal cut it."""
    try:
        checks = OmegaConf.to_container(cfg.signature.checks, resolve=True)
        scalars = records.scalars()
        plot_signals(scalars, records.modules(), run_dir / FIGURE, f"{cfg.name} (seed {cfg.seed}, {status})",
                     cfg.key_scalar, checked_scalars(checks, list(scalars.columns)))
    except KeyboardInterrupt:
        log.warning("%s not drawn: interrupted", FIGURE)
        return True
    except Exception as exc:  # noqa: BLE001 - a figure never costs the records
        log.warning("could not draw %s: %s", FIGURE, exc)
    return False


def _print_result(cfg: DictConfig, t: Training, verdict: Any, outcome: Outcome, summary: Dict[str, Any],
                  run_dir: Path) -> None:
    if outcome.status == "interrupted":
        print(f"{cfg.name}: interrupted ({summary.get('signal')}); no verdict")
    else:
        print(format_verdict(verdict, cfg.name, cfg.claim_kind))
        if verdict is not None and not verdict.reproduced and cfg.page:  # where to read why
            print(not_held_note(cfg.name, cfg.page))
    if t.device_mismatch is not None:
        m = t.device_mismatch
        print(f"device mismatch at the first forward pass: {', '.join(m.tensors)} stayed on "
              f"{', '.join(sorted(set(m.held_on)))} while the parameters are on {m.device} ({m.error})")
    print(f"status: {outcome.status}; run folder: {run_dir}")
