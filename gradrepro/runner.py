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
from gradrepro.figure import plot_signals
from gradrepro.init import initialize
from gradrepro.models import build_model
from gradrepro.objectives import build_objective
from gradrepro.optim import build_optimizer, freeze
from gradrepro.precision import Precision
from gradrepro.probe import Probe
from gradrepro.reference import measure_reference
from gradrepro.signature import RunRecords, evaluate, format_verdict

log = logging.getLogger(__name__)

FLUSH_SECONDS = 10.0  # records are rewritten (atomically) at most this often during a run


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
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def progress(total: int, desc: str):
    from tqdm.auto import tqdm

    # Quiet when output is not a terminal (CI, pipes, Hydra multirun logs).
    return tqdm(total=total, desc=desc, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Train as ``cfg`` says, write the run directory, return the summary."""
    validate(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed, device)
    start = time.perf_counter()

    data = build_data(cfg.data, cfg.seed).to(device)
    objective = build_objective(cfg.objective)
    init_rng = torch.get_rng_state()  # the state the weights are drawn from (reference.py)
    net = objective.wrap(build_model(cfg.model))
    initialize(net, cfg.init.scheme, cfg.init.std, cfg.init.mode)
    net.to(device).train()
    frozen = freeze(net, list(cfg.train.freeze))
    steps = cfg.train.steps
    optimizer, scheduler = build_optimizer(net, cfg.optim, steps)
    precision = Precision(cfg.precision, device)
    probe = Probe(net, cfg.probe, steps)
    probe.weight_decay = float(cfg.optim.weight_decay)
    records = store.Records(run_dir)
    generator = torch.Generator().manual_seed(cfg.seed)
    knn_k = cfg.eval.knn_k

    def evaluate_at(step: int) -> None:
        records.add_scalars({"step": step, **objective.evaluate(net, data, knn_k=knn_k)})

    evaluate_at(0)
    constants = {f"{k}_init": v for k, v in records.scalar_rows[0].items() if k != "step"}
    if cfg.init.reference:
        constants.update(measure_reference(cfg, data, objective, init_rng, generator, device))
    status, stopped_at, skipped = "completed", None, 0
    last_flush = time.monotonic()
    bar = progress(steps, cfg.name)
    step = 0
    with StopRequest() as stop:
        for step in range(steps):
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
                row["grad_norm"] = float(np.sqrt(np.nansum(columns["grad_norm"] ** 2)))
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
            if time.monotonic() - last_flush > FLUSH_SECONDS:
                records.flush()
                last_flush = time.monotonic()
        else:
            step = steps
    bar.close()
    if status == "completed" and steps > 0:
        evaluate_at(steps)
    elif status == "interrupted":
        pass  # stop quickly: the records up to the signal are what the user asked to keep
    records.flush()

    scalars, modules = records.scalars(), records.modules()
    verdict = evaluate(cfg.signature, RunRecords(scalars, modules, constants))
    summary = {
        "experiment": cfg.name,
        "control": cfg.control,
        "claim": cfg.claim,
        "reproduced": verdict.reproduced,
        "checks": verdict.as_dicts(),
        "paper": OmegaConf.to_container(cfg.paper, resolve=True),
        "status": status,
        "stopped_at": stopped_at,
        "steps": step if status == "completed" else (stopped_at or 0) + 1,
        "wall_s": round(time.perf_counter() - start, 3),
        "seed": cfg.seed,
        "overrides": list(overrides),
        "constants": constants,
        "frozen": frozen,
        "versions": versions(),
        "device": str(device) if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "threads": cfg.threads,
    }
    store.write_json(run_dir / store.SUMMARY, summary)
    try:
        plot_signals(scalars, modules, run_dir / store.FIGURE, f"{cfg.name} (seed {cfg.seed}, {status})",
                     cfg.key_scalar)
    except Exception as exc:  # a figure never costs the records
        log.warning("could not draw %s: %s", store.FIGURE, exc)
    print(format_verdict(verdict, cfg.name))
    print(f"status: {status}; run directory: {run_dir}")
    return summary
