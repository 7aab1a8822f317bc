"""The one training loop every experiment passes through.

    forward -> objective -> backward -> probe.collect -> optimizer.step -> probe.after_step

An experiment changes the graph or the numeric regime through config (a flag on an
objective, an init scheme, a precision mode, a frozen module), never through a copy of
this loop. The verdict is computed afterwards from the records alone (signature.py).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import gradrepro
from gradrepro import store
from gradrepro.config import validate
from gradrepro.data import build_data
from gradrepro.errors import UserError
from gradrepro.figure import plot_signals
from gradrepro.init import initialize
from gradrepro.loggers import open_records
from gradrepro.models import build_model
from gradrepro.modes import FrozenAudit, diagnostic_pass, hold_eval
from gradrepro.objectives import build_objective
from gradrepro.optim import build_optimizer, freeze
from gradrepro.precision import Precision
from gradrepro.probe import Probe
from gradrepro.reference import measure_reference
from gradrepro.signature import RunRecords, evaluate, format_verdict

log = logging.getLogger(__name__)

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cpu":
        # Bit-identical records for the same config and seed on CPU.
        torch.use_deterministic_algorithms(True, warn_only=True)


def versions() -> Dict[str, Optional[str]]:
    commit = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(gradrepro.__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradrepro": gradrepro.__version__,
        "git_commit": commit,
    }


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, records, and stops."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (some launchers): leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # a second signal: stop now (the records are still written)
            raise KeyboardInterrupt
        self.signal = signum

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signal).name if self.signal is not None else None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def progress(total: int, desc: str):
    from tqdm.auto import tqdm

    # Quiet when output is not a terminal (CI, pipes, Hydra multirun logs).
    return tqdm(total=total, desc=desc, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)


# What a reference run shares with the run that asked for it: what makes two runs
# comparable (seed, device, threads, step budget, scale), not the knob under study.
REFERENCE_CARRY = ("seed", "device", "threads", "train.steps")
_REFERENCE_MARK = "+_reference_of"


def _is_reference(overrides: Sequence[str]) -> bool:
    return any(o.startswith(_REFERENCE_MARK) for o in overrides)


def compose_experiment(overrides: Sequence[str]) -> DictConfig:
    """Compose a config inside a running Hydra app, or standalone (tests, notebooks)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gradrepro.cli import CONFIG_DIR
    from gradrepro.config import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_references(cfg: DictConfig, run_dir: Path, overrides: Sequence[str]):
    """Run each reference experiment (same seed, scale, device, budget) into
    run_dir/references/NAME and return (records by name, their summaries' essentials)."""
    import contextlib
    import io

    carried = [f"{key}={OmegaConf.select(cfg, key)}" for key in REFERENCE_CARRY]
    carried += [o for o in overrides if o.startswith("scale=")]
    records, runs = {}, {}
    for name, experiment in cfg.references.items():
        ref_overrides = [f"experiment={experiment}", *carried]
        ref_cfg = compose_experiment(ref_overrides)
        ref_dir = run_dir / "references" / name
        log.info("reference %s: experiment=%s", name, experiment)
        with contextlib.redirect_stdout(io.StringIO()):
            summary = run(ref_cfg, ref_dir, [*ref_overrides, f"{_REFERENCE_MARK}={cfg.name}"])
        _, scalars, modules = store.read_run(ref_dir)
        records[name] = RunRecords(scalars, modules, summary["constants"])
        runs[name] = {"experiment": experiment, "overrides": ref_overrides,
                      "status": summary["status"], "wall_s": summary["wall_s"],
                      "run_dir": f"references/{name}"}
    return records, runs


class SafeBar:
    """The progress bar, where a failure of the bar (a closed terminal, a formatting error)
    switches the bar off with a warning and never stops training or costs records."""

    def __init__(self, total: int, desc: str) -> None:
        self._bar = None
        self._call(lambda: setattr(self, "_bar", progress(total, desc)))

    def _call(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the bar must never stop a run
            log.warning("progress bar switched off: %s", exc)
            self._bar = None

    def set_postfix(self, **kwargs: Any) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.set_postfix(**kwargs))

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.update(n))

    def close(self) -> None:
        if self._bar is not None:
            self._call(lambda: self._bar.close())


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Train as ``cfg`` says, write the run directory, return the summary.

    Whatever ends the run (the last step, a non-finite loss or gradient, SIGINT/SIGTERM, an
    exception), the records so far are written and ``summary.json`` says which it was
    (``status``); an exception is re-raised after that.
    """
    validate(cfg)
    run_dir = Path(run_dir)
    store.ensure_writable_dir(run_dir)  # before any work: a read-only or full disk is one line
    with StopRequest() as stop:
        return _train(cfg, run_dir, overrides, stop)


def _train(cfg: DictConfig, run_dir: Path, overrides: Sequence[str], stop: StopRequest) -> dict[str, Any]:
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed, device)
    start = time.perf_counter()

    what = "data"
    try:  # a value only the building code rejects (a size, a missing table entry): one line
        data = build_data(cfg.data, cfg.seed).to(device)
        check_data_shape(data, cfg.data)
        what = "model, objective or optimizer"
        objective = build_objective(cfg.objective)
        init_rng = torch.get_rng_state()  # the state the weights are drawn from (reference.py)
        net = objective.wrap(build_model(cfg.model))
        initialize(net, cfg.init.scheme, cfg.init.std, cfg.init.mode)
        net.to(device).train()
        held = hold_eval(net, list(cfg.train.eval_modules))  # the mode policy
        frozen = freeze(net, list(cfg.train.freeze))
        audit = FrozenAudit(net, frozen, data.eval_sets()[2][:256]) if frozen else None
        steps = cfg.train.steps
        optimizer, scheduler = build_optimizer(net, cfg.optim, steps)
        # A network may act once its optimizer exists (a case that replaces a module after the
        # optimizer was built; an evaluation that diagnoses one step of that optimizer).
        if callable(getattr(net, "on_optimizer", None)):
            net.on_optimizer(optimizer)
        precision = Precision(cfg.precision, device)
        probe = Probe(net, cfg.probe, steps)
        probe.weight_decay = float(cfg.optim.weight_decay)
        what = "objective"
        check_forward(objective, net, data, cfg.seed)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, MemoryError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if what == "objective":
            raise UserError(f"the model and the data do not fit together (data.num_classes, "
                            f"model.num_classes, sizes?): {first}") from None
        raise UserError(f"the {what} cannot be built from this config: {first}") from None
    records = open_records(cfg.logger, run_dir, net)  # logger=tensorboard also writes there
    generator = torch.Generator().manual_seed(cfg.seed)
    knn_k = cfg.eval.knn_k

    def evaluate_at(step: int) -> None:
        records.add_scalars({"step": step, **objective.evaluate(net, data, knn_k=knn_k)})
        hold_eval(net, held)  # evaluate's net.train() put every module back in train mode

    evaluate_at(0)
    constants = {f"{k}_init": v for k, v in records.scalar_rows[0].items() if k != "step"}
    if cfg.init.reference:
        constants.update(measure_reference(cfg, data, objective, init_rng, generator, device))
    status, stopped_at, skipped, error = "completed", None, 0, None
    last_flush, period = None, flush_seconds()  # first flush right after the first logged step
    bar = SafeBar(steps, cfg.name)
    step = 0
    try:
        for step in range(steps):
            if stop.signal is not None:  # a signal that came before this step (during setup)
                status, stopped_at = "interrupted", (step - 1 if step else None)
                break
            logged = probe.logs(step)
            if logged:
                probe.arm()
            batch = data.sample(generator)
            if cfg.train.zero_grad:
                optimizer.zero_grad(set_to_none=True)
            with precision.autocast():
                out = objective(net, batch)
            loss_value = float(out.loss.detach())
            diverged = not math.isfinite(loss_value)
            logged = logged or diverged  # record the step where it broke
            contribute = logged and cfg.probe.task_contribution and len(out.terms) > 1
            probe.loss_scale = precision.loss_scale
            if logged:
                probe.lr = optimizer.param_groups[0]["lr"]
                probe.before_backward(step)
            precision.backward(out.loss, retain_graph=contribute)
            if contribute:
                probe.contribution(out.terms)
            precision.unscale(optimizer)
            if logged:
                probe.collect()
            if cfg.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.train.grad_clip)
            stepped = False
            if not diverged:
                stepped = precision.step(optimizer)
                skipped += not stepped
                scheduler.step()
            if logged:
                probe.disarm()
                columns = probe.after_step(step)
                records.add_modules(columns)
                row = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                       "loss_scale": precision.loss_scale, "skipped_steps": skipped}
                row["grad_norm"] = total_grad_norm(columns)
                row["fresh_grad_norm"] = float(np.sqrt(np.nansum(columns["fresh_grad_norm"] ** 2)))
                row.update({k: float(v) for k, v in out.scalars.items()})
                records.add_scalars(row)
                nonfinite_grads = bool((columns["grad_state"] == "nonfinite").any())
                if nonfinite_grads and not precision.skips_nonfinite:
                    diverged = True
                bar.set_postfix(loss=f"{loss_value:.4f}", **(
                    {cfg.key_scalar: f"{row[cfg.key_scalar]:.4g}"}
                    if cfg.key_scalar in row else {}))
            bar.update(1)
            if diverged:
                status, stopped_at = "diverged", step
                break
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < steps:
                evaluate_at(step + 1)
            if stop.signal is not None:
                status, stopped_at = "interrupted", step
                break
            if logged and (last_flush is None or time.monotonic() - last_flush > period):
                flush_or_warn(records)
                last_flush = time.monotonic()
        else:
            step = steps
    except KeyboardInterrupt:  # a second signal, or Ctrl-C where no handler could be set
        status, stopped_at = "interrupted", step
    except Exception as exc:  # noqa: BLE001 - a bug: keep what was recorded, then re-raise
        status, stopped_at, error = "failed", step, exc
    bar.close()
    if status == "completed" and steps > 0:
        evaluate_at(steps)
    # An interrupted run stops quickly: the records up to the signal are what the user asked
    # to keep. A diverged or failed run is evaluated on what exists.
    records.flush()
    records.close()
    if audit is not None:
        constants.update(audit.finish(net))
    if cfg.eval.diagnose.mode is not None and status == "completed":
        constants.update(diagnostic_pass(net, objective, data, cfg.eval.diagnose, held))

    scalars, modules = records.scalars(), records.modules()
    references, reference_runs = {}, {}
    if status == "completed" and cfg.references and not _is_reference(overrides):
        references, reference_runs = run_references(cfg, run_dir, overrides)
    verdict = evaluate(cfg.signature, RunRecords(scalars, modules, constants, references))
    summary = {
        "experiment": cfg.name,
        "control": cfg.control,
        "claim": cfg.claim,
        "reproduced": verdict.reproduced,
        "checks": verdict.as_dicts(),
        "paper": OmegaConf.to_container(cfg.paper, resolve=True),
        "status": status,
        "stopped_at": stopped_at,
        "steps": step if status == "completed" else (0 if stopped_at is None else stopped_at + 1),
        "wall_s": round(time.perf_counter() - start, 3),
        "seed": cfg.seed,
        "overrides": list(overrides),
        "constants": constants,
        "references": reference_runs,
        "frozen": frozen,
        "eval_modules": held,
        "versions": versions(),
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "threads": cfg.threads,
    }
    if status == "interrupted":
        summary["signal"] = stop.name or "SIGINT"
    if error is not None:
        summary["error"] = f"{type(error).__name__}: {error}"
    store.write_json(run_dir / store.SUMMARY, summary)
    if error is not None:
        raise error
    try:
        plot_signals(scalars, modules, run_dir / store.FIGURE, f"{cfg.name} (seed {cfg.seed}, {status})",
                     cfg.key_scalar)
    except Exception as exc:  # noqa: BLE001 - a figure never costs the records
        log.warning("could not draw %s: %s", store.FIGURE, exc)
    print(format_verdict(verdict, cfg.name))
    print(f"status: {status}; run directory: {run_dir}")
    return summary


def check_forward(objective: Any, net: torch.nn.Module, data: Any, seed: int) -> None:
    """One loss on one batch before training, so that a model and data that do not fit
    (fewer logits than classes, say) are one line, not a traceback at step 0. Changes no
    state: eval mode (BatchNorm statistics untouched), no gradients, its own generator."""
    modes = [(m, m.training) for m in net.modules()]  # restored exactly (a mode policy)
    net.eval()
    try:
        with torch.no_grad():
            objective(net, data.sample(torch.Generator().manual_seed(seed)))
    finally:
        for module, training in modes:
            module.training = training


def check_data_shape(data: Any, cfg_data: Any) -> None:
    """Models are built from ``data.channels`` and ``data.image_size``; a data choice whose
    images differ (those keys overridden for data that fixes them) is bad input, not a crash
    at the first forward pass."""
    got = tuple(data.x_train.shape[1:])
    said = (cfg_data.channels, cfg_data.image_size, cfg_data.image_size)
    if got != said:
        raise UserError(
            f"data={cfg_data.name} gives images of {'x'.join(map(str, got))} but "
            f"data.channels / data.image_size say {'x'.join(map(str, said))}; leave them at "
            f"the data choice's values")


def total_grad_norm(columns: dict[str, np.ndarray]) -> float:
    """The whole model's gradient norm: tensors without a gradient (``none``) are left out,
    a non-finite one makes the total non-finite (it is recorded, never dropped)."""
    has_grad = columns["grad_state"] != "none"
    return float(np.sqrt(np.sum(np.asarray(columns["grad_norm"], dtype=float)[has_grad] ** 2)))


def flush_or_warn(records: store.Records) -> None:
    """A periodic flush that fails (a full disk) warns and keeps the records in memory for
    the final write; training goes on."""
    try:
        records.flush()
    except OSError as exc:
        log.warning("could not write the records yet (%s); will try again at the end", exc)
