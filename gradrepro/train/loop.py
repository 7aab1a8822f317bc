"""The one training loop every experiment passes through: the forward/backward/step core.

    forward -> objective -> backward -> probe.collect -> optimizer.step -> probe columns

(the forward and backward once per micro-batch with gradient accumulation, ``train.accumulate``)

An experiment changes the graph or the numeric regime through config (a flag on an
objective, an init scheme, a precision mode, a frozen module), never through a copy of
this loop. What else a run measures is asked of its measurements (``gradrepro.measure``) on
logged steps; the stages around the loop (validate, build, measurements, references,
verdict, summary, figure) are the experiment pipeline (``train/pipeline.py``).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import torch
from omegaconf import DictConfig

from gradrepro.data import split_batch
from gradrepro.measure import Measurement
from gradrepro.objectives import micro_batch_weights
from gradrepro.probe.probe import step_norms
from gradrepro.recipe.build import Training
from gradrepro.recipe.clipping import clip_at
from gradrepro.records.writer import Records
from gradrepro.train.finish import Outcome
from gradrepro.train.session import SafeBar, StopRequest

log = logging.getLogger(__name__)


def train_steps(cfg: DictConfig, t: Training, records: Records, generator: torch.Generator, stop: StopRequest,
                measure_held_out: Callable[[int], None], measurements: Sequence[Measurement] = ()) -> Outcome:
    """The training steps, until the last one, a divergence, a signal or an exception."""
    steps = cfg.train.steps
    outcome = Outcome()
    bar = SafeBar(steps, cfg.name)
    step = 0
    try:
        for step in range(steps):
            if stop.signal is not None:  # a signal that came before this step (during setup)
                outcome.status, outcome.stopped_at = "interrupted", (step - 1 if step else None)
                break
            logged, diverged = train_step(cfg, t, records, generator, step, outcome, bar, measurements)
            bar.update(1)
            if diverged:
                outcome.status, outcome.stopped_at = "diverged", step
                break
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < steps:
                measure_held_out(step + 1)
            if stop.signal is not None:
                outcome.status, outcome.stopped_at = "interrupted", step
                break
            if logged and records.due():  # the first right after the first logged step
                flush_or_warn(records)
        else:
            step = steps
    except KeyboardInterrupt:  # a second signal, or Ctrl-C where no handler could be set
        outcome.status, outcome.stopped_at = "interrupted", step
    except Exception as exc:  # noqa: BLE001 - a bug: keep what was recorded, then re-raise
        outcome.status, outcome.stopped_at, outcome.error = "failed", step, exc
    bar.close()
    outcome.step = step
    return outcome


def train_step(cfg: DictConfig, t: Training, records: Records, generator: torch.Generator, step: int,
               outcome: Outcome, bar: SafeBar, measurements: Sequence[Measurement] = ()) -> tuple[bool, bool]:
    """One training step; returns (logged, diverged). Measurements act on logged steps only."""
    batch = t.data.sample(generator)
    if cfg.train.zero_grad:
        t.optimizer.zero_grad(set_to_none=True)
    scale = t.precision.loss_scale  # of this step's backward (a dynamic scale moves at the step)
    with t.probe.step(step, lr=t.optimizer.param_groups[0]["lr"], loss_scale=scale) as p:
        measuring = list(measurements) if p.logged else []
        for m in measuring:
            m.before_forward(p)
        # Gradient accumulation: train.accumulate micro-batches, each one forward and backward
        # with its loss weighted as train.accumulate_norm says; .grad sums them. One: the batch.
        parts = split_batch(batch, cfg.train.accumulate)
        weights, items = micro_batch_weights(t.objective, parts, cfg.train.accumulate_norm)
        loss_value, scalars, diverged = 0.0, {}, False
        for part, weight, share in zip(parts, weights, items):
            with t.precision.autocast():
                out = t.objective(t.net, part)
            part_loss = float(out.loss.detach())
            loss_value += share * part_loss  # the batch's mean over its items, whatever the weights
            for k, v in out.scalars.items():
                scalars[k] = scalars.get(k, 0.0) + share * float(v)
            if not math.isfinite(part_loss) and not diverged:
                diverged = True
                if not p.logged:
                    p.log_anyway()  # record the step where it broke
                    measuring = list(measurements)
            keep_graph = any([m.keeps_graph(p, out) for m in measuring])
            t.precision.backward(out.loss if weight == 1 else out.loss * weight, retain_graph=keep_graph)
            for m in measuring:
                m.after_backward(p, out)
        # Clip after unscaling (PyTorch's AMP examples); train.clip_order=before_unscale is the
        # mistake the clipping experiments show. The probe then sees what the optimizer steps with.
        clipped = clip_at(cfg.train, t.net.parameters(), "before_unscale")
        t.precision.unscale(t.optimizer)
        clipped = clipped or clip_at(cfg.train, t.net.parameters(), "after_unscale")
        p.collect()
        for m in measuring:
            m.after_collect(p, batch)
        if not diverged:
            outcome.skipped += not t.precision.step(t.optimizer)
            t.scheduler.step()
    if not p.logged:
        return False, diverged
    columns = p.columns
    for m in measuring:
        columns.update(m.step_columns(p))
    records.add_modules(columns)
    # loss_scale: the scale this step's gradients were scaled by (the probe's, and the recorder's).
    row = {"step": step, "loss": loss_value, "lr": t.scheduler.get_last_lr()[0],
           "loss_scale": scale, "skipped_steps": outcome.skipped,
           "scale_growths": t.precision.growths, "scale_backoffs": t.precision.backoffs, **step_norms(columns)}
    row.update(scalars)
    row.update({k: float(v) for k, v in clipped.items()})
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
