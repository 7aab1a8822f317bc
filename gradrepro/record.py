"""The probe in your own training loop: ``gradrepro.record``.

    rec = gradrepro.record(model, optimizer, "runs/mine", every=10)   # hooks; the loop is unchanged
    for x, y in loader:
        optimizer.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); optimizer.step()
        rec.log(loss=loss)        # optional scalars; tensors are read on logged steps only
    rec.close()                   # or: with gradrepro.record(...) as rec:

It writes the run folder the built-in experiments write (``summary.json`` with ``status`` and
no signature, ``scalars.parquet``, ``modules.parquet``, ``signals.png``), atomically, right
after the first logged step, then every ``FLUSH_SECONDS`` and at the end, so
``python -m gradrepro.compare runs/mine`` reads it beside built-in runs.

A step is one ``optimizer.step()``. Three hooks find its boundaries in a loop gradrepro does
not control:

- the model's forward pre-hook: the first forward pass with gradients enabled after a step
  begins the next one (on a logged step the probe arms its activation hooks); evaluation
  passes under ``torch.no_grad()`` are not steps;
- the optimizer's step pre-hook (torch >= 2.0): the gradients are complete, after every
  backward of an accumulated step and after a ``GradScaler``'s unscale; the probe reads them;
- the optimizer's step post-hook: the update is taken; the probe's columns are made.

Several optimizers over one model (Muon for the matrices and AdamW for the rest): give them as
a list, ``record(model, [muon, adamw], ...)``; a step begins at the first one's step and ends
once each has stepped (``watch.optimizers``).

A step the ``GradScaler`` skips (non-finite gradients) calls no ``optimizer.step()``: no hook
fires and it is not a step of the record. On a step that is not logged the hooks only count.
Without optimizer hooks (``hooks=False``, or an optimizer that has none) call ``rec.begin()``,
``rec.before_step()`` and ``rec.after_step()`` yourself, as the Lightning callback does.

Distributed (DDP, FSDP2's ``fully_shard``, a plain ``torch.distributed`` loop): create the
recorder on every process, after wrapping or sharding the model. The statistics are of the
full, synchronised tensors (probe/shards.py: one collective per logged step); rank 0 writes
the run folder, the others nothing (``every_rank=True``: each its own ``<run_dir>-rank<r>``).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import sys
import time
import types
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from gradrepro.diagnose.report import INFO, Finding
from gradrepro.diagnose.scaled_clip import clipped_while_scaled
from gradrepro.errors import UserError
from gradrepro.probe import ranks
from gradrepro.probe.config import BEFORE_ON, ProbeConfig
from gradrepro.probe.probe import Probe, ProbeStep, step_norms
from gradrepro.probe.wrappers import autocast_bf16, has_bf16, is_compiled, run_eagerly, unwrap
from gradrepro.records.claim import claim, release
from gradrepro.records.figure import plot_signals
from gradrepro.records.files import FIGURE, SUMMARY, ensure_writable_dir, write_json
from gradrepro.records.provenance import versions
from gradrepro.records.run import RUN_SCALARS
from gradrepro.records.writer import Records
from gradrepro.watch.invariants import recorder_error_hit
from gradrepro.watch.optimizers import as_optimizer
from gradrepro.watch.over_steps import StepStates
from gradrepro.watch.watcher import KINDS, FindingError, LiveFinding, TrainingFinding, Watch, check_options

log = logging.getLogger(__name__)

# Columns the recorder writes itself: rec.log() may not replace them (``loss`` is the user's).
RESERVED = tuple(name for name in RUN_SCALARS if name != "loss")


@dataclass(frozen=True)
class RecordOptions:
    """What ``gradrepro.record`` records and how it reports; every field has a default.

    Args:
        every: log every this many optimizer steps (a whole number >= 1); the steps between only count.
        name: the run's name in ``summary.json``; default the run folder's name.
        scaler: the loop's ``torch.amp.GradScaler``, if any: its scale is recorded as ``loss_scale``
            and the steps it skips are not steps of the record.
        activations: record activation statistics (``act_mean``, ``act_std``, ``act_grad_std``)
            on logged steps.
        act_sample: examples (the first rows of each batch) whose activations and activation gradients
            those statistics summarise.
        act_values: at most this many values of each module's output (and of its gradient) enter
            those statistics: of the ``act_sample`` examples, as many whole examples as fit, at
            least one; 0 takes every value of the ``act_sample`` examples. The default, 65,536
            (2^16), keeps a fraction's binomial standard error under 0.2 percentage points
            (0.5 / sqrt(65,536)), treating the values as independent.
        hooks: find each step from the optimizer's step hooks; False: call ``rec.begin()``,
            ``rec.before_step()`` and ``rec.after_step()`` yourself (the update rule is then not checked).
        bf16: count the updates bf16 weights round away: True, False, or None (when a weight is
            bf16 or the step runs under bf16 autocast).
        every_rank: each process of a distributed run writes its own ``<run_dir>-rank<r>``; default
            rank 0 alone writes.
        timeout: seconds the first logged step waits for every process's recorder.
        eager_logged_steps: a ``torch.compile``d model's logged steps run uncompiled, so that its
            activations are recorded.
        live: run the watch (``gradrepro.watch``): the per-step checks, reported at the logged
            step a finding first appears.
        on_finding: what a live finding does: ``"warn"`` (a ``TrainingFinding`` warning),
            ``"raise"`` (``FindingError``) or ``"log"`` (the ``gradrepro.watch.watcher`` logger).
        silence: kinds of live finding not reported (names from ``gradrepro.watch.KINDS``).
        steps: the number of steps the loop will take, if known: the last one is then logged in full.
        before_on: where the copy of the parameters taken before a logged step's optimizer step
            lives: ``"device"`` or ``"host"`` (off the GPU; ``probe.config.ProbeConfig``).
    """

    every: int = 10
    name: Optional[str] = None
    scaler: Any = None
    activations: bool = True
    act_sample: int = 8
    act_values: int = 1 << 16
    hooks: bool = True
    bf16: Optional[bool] = None
    every_rank: bool = False
    timeout: float = ranks.HANDSHAKE_SECONDS
    eager_logged_steps: bool = False
    live: bool = True
    on_finding: str = "warn"
    silence: Any = ()
    steps: Optional[int] = None
    before_on: str = "device"

    def __post_init__(self) -> None:
        every, steps = self.every, self.steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UserError(f"every={every!r} must be a whole number of steps >= 1")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise UserError(f"steps={steps!r} must be the whole number of steps the loop takes (>= 1), or None")
        for key, least in (("act_sample", 1), ("act_values", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserError(f"{key}={value!r} must be a whole number >= {least}")
        if self.before_on not in BEFORE_ON:
            raise UserError(f"before_on={self.before_on!r} is not valid; choose one of: {', '.join(BEFORE_ON)}")
        check_options(self.on_finding, self.silence)

    @classmethod
    def of(cls, options: Optional[RecordOptions] = None, **changes: Any) -> RecordOptions:
        """``options`` (default: the defaults) with the fields named in ``changes`` replaced; an
        unknown name is one line that lists the valid ones."""
        if options is not None and not isinstance(options, cls):
            raise UserError(f"options must be a gradrepro.record.RecordOptions, not {type(options).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = [k for k in changes if k not in names]
        if unknown:
            raise UserError(f"{unknown[0]!r} is not an option of gradrepro.record; the options are: {', '.join(names)}")
        return replace(options or cls(), **changes)



class Recorder:
    """Records one model's gradient signals over a training loop (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], run_dir: str | Path,
                 options: Optional[RecordOptions] = None, **changes: Any) -> None:
        self.options = o = RecordOptions.of(options, **changes)
        every, name, scaler, activations, act_sample, hooks = (o.every, o.name, o.scaler, o.activations,
                                                               o.act_sample, o.hooks)
        bf16, every_rank, timeout, eager_logged_steps = o.bf16, o.every_rank, o.timeout, o.eager_logged_steps
        live, on_finding, silence, steps, before_on = o.live, o.on_finding, o.silence, o.steps, o.before_on
        optimizer = as_optimizer(optimizer)  # a list: several optimizers that step after one backward
        _check(model, optimizer)
        self.model, self.optimizer, self.scaler, self.every = model, optimizer, scaler, every
        self.run_dir = Path(run_dir)
        group = ranks.process_group()
        self.rank = group[0] if group else 0
        if self.rank > 0 and every_rank:
            self.run_dir = self.run_dir.with_name(f"{self.run_dir.name}-rank{self.rank}")
        self._writes = self.rank == 0 or every_rank  # rank 0 writes the run folder
        if self._writes:  # one run, one folder, as for the command line: claimed before anything is written
            self.run_dir = claim(self.run_dir, "run folder", exclusive=True)
        try:
            if self._writes:
                ensure_writable_dir(self.run_dir)  # an unwritable folder is one line, before any step
            _check_optimizer_of(model, optimizer)
            self.name = name or self.run_dir.resolve().name
            weight_decay = float(optimizer.param_groups[0].get("weight_decay", 0.0)) if optimizer else 0.0
            cfg = ProbeConfig(every=every, activations=activations, act_sample=act_sample, act_values=o.act_values,
                              task_contribution=False, before_on=before_on)
            self.net = unwrap(model)  # DDP's and torch.compile's wrappers: the names of the model itself
            self.records = Records(self.run_dir)
            self._states = StepStates()  # per parameter over the logged steps, kept as they come (findings)
            self._bf16, self._on_finding, self._stopped, self._hooks = bf16, on_finding, False, hooks
            self.probe, self.combiner, self.watch = None, None, None
            # Built now, or, where a lazy module creates its parameters in the first forward
            # pass (nn.LazyLinear), when that pass has created them (``_materialised``).
            self._build = lambda: self._build_probe(cfg, steps, weight_decay, timeout, live, on_finding, silence)
            if not any(is_lazy(p) for p in self.net.parameters()):
                self._build()
            self.step = 0  # optimizer steps taken so far: the index of the step in progress
            self.status: Optional[str] = None  # set by close()
            self._begun = False
            self._begun_at: Optional[tuple] = None  # where the forward pass that began the step was called
            self._eager, self._restore = False, None  # eager logged steps of a compiled model (below)
            self._current: Optional[ProbeStep] = None  # the logged step in progress
            self._scalars: dict[str, Any] = {}  # rec.log() values of the step in progress
            self._open_row: Optional[dict[str, Any]] = None  # the last logged step's row, open to rec.log()
            self._last_row: Optional[dict[str, Any]] = None  # the last unlogged step's scalars (read at close)
            self._start, self._versions = time.perf_counter(), versions()
            self._handles: list = []
            self._stepping = False  # between the optimizer's step pre-hook and its post-hook
            if hooks:
                if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
                    raise UserError(f"{type(optimizer).__name__} has no step hooks (torch.optim.Optimizer, "
                                    "torch >= 2.0): pass hooks=False and call rec.begin(), rec.before_step() and "
                                    "rec.after_step() around each optimizer step")
                # A compiled model's logged steps run eagerly when asked, so that its activations
                # are recorded (hooks inside a compiled graph are left out: probe.py).
                self._eager = eager_logged_steps and is_compiled(model)
                self._handles = [model.register_forward_pre_hook(self._on_forward),
                                 model.register_forward_hook(self._after_forward),
                                 optimizer.register_step_pre_hook(self._pre_step),
                                 optimizer.register_step_post_hook(lambda *_: self.after_step())]
            self._write_summary("running")
        except BaseException:
            if self._writes:
                release(self.run_dir)
            raise

    def _build_probe(self, cfg: ProbeConfig, steps: Optional[int], weight_decay: float, timeout: float,
                     live: bool, on_finding: str, silence: Any) -> None:
        # ``steps`` known: the last step is logged, as in the built-in runs.
        self.probe = Probe(self.net, cfg, total_steps=steps, weight_decay=weight_decay)
        self.probe.carry_at_backward = True  # a loop may zero_grad() between forward and backward
        self.combiner = ranks.attach(self.probe, timeout)
        # bf16 rounding: always, never, or (None) when a weight is bf16 or bf16 autocast is on.
        self._bf16_weights = has_bf16(self.probe.params)
        # findings reported at the logged step they appear (gradrepro.watch)
        self.watch = (Watch(self.model, self.optimizer, self.probe, self.scaler, self.run_dir, on_finding,
                                silence) if live else None)
        if self.watch is not None and not self._hooks:
            # Called by hand (or by Lightning, before its gradient clipping), before_step() need not be
            # the moment right before the optimizer's step: the update rule is not checked.
            self.watch.rule.enabled = False
            self.watch.at_step = False

    # -- the recorder's own failures: one finding, recording stops, the loop goes on -----------
    def _guard(self, fn: Any, where: str, *args: Any) -> None:
        if self.status is not None:
            raise UserError(f"rec.{where}() on a closed recorder (rec.close() ran, or its with-block ended): "
                            "nothing more is recorded; call it before closing")
        if self._stopped:
            return
        try:
            fn(*args)
        except (FindingError, UserError):
            raise
        except Exception as exc:  # noqa: BLE001 - the recorder never breaks the user's loop (unless asked)
            self._fail(exc, where)

    def _fail(self, exc: Exception, where: str) -> None:
        if self._on_finding == "raise":
            raise exc
        self._stopped = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            self._after_forward(self.model, (), None)
            if self.watch is not None:
                self.watch.close()
            if self._current is not None:
                current, self._current = self._current, None
                current.__exit__(RuntimeError, None, None)
        except Exception:  # noqa: BLE001 - already failing: what is left is dropped
            self._current = None
        if self.watch is not None:
            self.watch.recorder_failed(self.step, exc, where)
            return
        finding = LiveFinding(*recorder_error_hit(exc, where)[:3], KINDS["recorder_error"], step=self.step)
        if self._on_finding == "log":
            log.warning("%s", finding)
        else:
            warnings.warn(str(finding), TrainingFinding, stacklevel=3)

    def _materialised(self) -> bool:
        """Whether the probe exists, built now if a lazy module's parameters were just created."""
        if self.probe is None:
            if any(is_lazy(p) for p in self.net.parameters()):
                return False
            self._build()
        return True

    # -- the step protocol: called by the hooks, or by you with hooks=False ------------------
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        self._guard(self._on_forward_, "forward pre-hook")

    def _on_forward_(self) -> None:
        if not torch.is_grad_enabled():
            return
        starts = not self._begun
        self._begin()  # while a step is in progress: only the live loss-scale check
        if starts:  # where the forward pass that began the step was called (see ``log``)
            self._begun_at = _caller_line()
        elif self.watch is not None and self.probe is not None and not self._stepping:
            # a pass inside the optimizer's step (a closure's: LBFGS's line search) is the optimizer's
            self.watch.each_forward_again(self.step, self.probe.logs(self.step), self.every)
        if starts and self._current is not None and self._bf16 is None and autocast_bf16(self.probe.params[0]):
            self.probe.bf16 = True
        if starts and self._current is not None and self._eager:
            self._restore = run_eagerly()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._restore is not None:
            self._restore, restore = None, self._restore
            restore()
        if self.probe is None and self._begun and output is not None and self.status is None:
            self._guard(self._start_late, "forward hook")

    def _start_late(self) -> None:
        """The first forward pass created a lazy module's parameters: the probe is built and,
        if this step is logged, it is recorded from here (its activations are not)."""
        if self._materialised() and self.probe.logs(self.step):
            self._begun = False
            self._begin()

    def begin(self) -> None:
        """A step begins (before its first forward pass). The last logged step's row closes."""
        self._guard(self._begin, "begin")

    def _begin(self) -> None:
        if self._begun:
            if self._current is not None and self.watch is not None:
                self.watch.step_retried(self.step)  # a skipped step's retry, or the next micro-batch
            return
        self._begun, self._begun_at = True, None  # the last row stays open to rec.log until this step's gradients
        if not self._materialised():
            return
        if self.watch is not None:
            self.watch.each_begin(self.step, self.probe.logs(self.step))
        if self.probe.logs(self.step):
            if self.probe.params and self.probe.params[0].is_meta:
                raise RuntimeError("the parameters are on the meta device: they hold no values to record")
            self.probe.bf16 = bool(self._bf16 if self._bf16 is not None else self._bf16_weights)
            lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else math.nan
            scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0
            self._current = self.probe.step(self.step, lr=lr, loss_scale=scale)
            self._current.__enter__()
            if self.watch is not None:
                self.watch.begin(self.step)

    def _pre_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The optimizer's step pre-hook. ``step(closure)`` (LBFGS; any optimizer given one) makes
        the gradients inside the step: they are read after the closure's first evaluation, at the
        parameters the step starts from, instead of now, when they do not exist yet."""
        # torch passes the optimizer itself as args[0], then step's own arguments
        self._stepping = True
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            self.before_step()
            return None
        first = [True]

        def closure_then_read() -> Any:
            result = closure()
            if first[0]:
                first[0] = False
                self.before_step()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_read}
        return (args[0], closure_then_read, *args[2:]), kwargs

    def before_step(self) -> None:
        """The gradients are complete (after backward, unscaling and accumulation)."""
        self._guard(self._before_step, "before_step")

    def _before_step(self) -> None:
        self._begin()  # a step whose forward pass no hook saw
        self._close_row()
        if not self._materialised():
            return
        if self.watch is not None:
            self.watch.each_before_step()
        if self._current is not None:
            _check_same_params(self.net, self.probe.params)
            if self.watch is not None:
                self.watch.before_step()
            self._current.collect()

    def after_step(self) -> None:
        """The optimizer has updated the parameters: the step ends."""
        self._guard(self._after_step, "after_step")

    def _after_step(self) -> None:
        self._stepping = False
        self._begin()
        self._close_row()
        current, self._current = self._current, None
        scalars, self._scalars = self._scalars, {}
        if current is None:  # the lr this step used (a scheduler may change it after the step)
            lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else math.nan
            self._last_row = {**scalars, "step": self.step, "lr": lr}
        else:
            self._last_row = None
        if current is not None:
            current.__exit__(None, None, None)
            if current.columns is not None:
                self.records.add_modules(current.columns)
                self._states.add(current.columns)
                self._open_row = {"step": self.step, "loss": math.nan, "lr": self.probe.lr,
                                  "loss_scale": self.probe.loss_scale, **step_norms(current.columns),
                                  **{k: _number(v) for k, v in scalars.items()}}
        self.step += 1
        self._begun = False
        if current is not None and self._writes and self.records.due():
            self.flush()
        if self.watch is not None:
            self.watch.each_after_step(self.step - 1, current is not None)
        if current is not None and self.watch is not None:
            self.watch.after_step(self.step - 1, current.columns)  # last: it may raise (on_finding="raise")

    def log(self, **scalars: Any) -> None:
        """Scalars of the step in progress, or, after ``optimizer.step()``, of the step just
        taken. Numbers or one-element tensors; a tensor is read (one host sync) only when its
        step is logged. The recorder's own columns (``RESERVED``) are refused."""
        if self.status is not None:
            raise UserError("rec.log() on a closed recorder (rec.close() ran, or its with-block ended): nothing "
                            "more is recorded; log before closing")
        taken = sorted(set(scalars) & set(RESERVED))
        if taken:
            raise UserError(f"rec.log({', '.join(taken)}=...): reserved column(s) the recorder writes itself "
                            f"({', '.join(RESERVED)}); log under another name")
        for name, value in scalars.items():
            _check_scalar(name, value)
        # ``rec.log(logits=model(x))`` after optimizer.step(): the forward pass in the call's own
        # arguments began the next step; its values belong to the step just taken.
        inside_call = self._begun and self._begun_at is not None and self._begun_at == _caller_line()
        if self._begun and not inside_call:
            self._scalars.update({k: v.detach() if torch.is_tensor(v) else v for k, v in scalars.items()})
        elif self._open_row is not None and self._open_row["step"] == self.step - 1:
            self._open_row.update({k: _number(v) for k, v in scalars.items()})
        elif self._last_row is not None and self._last_row["step"] == self.step - 1:
            self._last_row.update({k: v.detach() if torch.is_tensor(v) else v for k, v in scalars.items()})

    # -- the run folder -------------------------------------------------------------------------
    def _close_row(self) -> None:
        if self._open_row is not None:
            self.records.add_scalars(self._open_row)
            self._open_row = None

    def flush(self) -> None:
        """Write the records so far and the summary (atomically); a failing disk warns, the
        records stay in memory for the next write."""
        if not self._writes:
            return
        try:
            self.records.flush()
            self._write_summary(self.status or "running")
        except OSError as exc:
            log.warning("could not write the records yet (%s); will try again", exc)

    def _write_summary(self, status: str, error: Optional[BaseException] = None) -> None:
        if not self._writes:
            return
        param = next(self.model.parameters(), None)
        summary = {"experiment": self.name, "control": None, "status": status, "steps": self.step,
                   "wall_s": round(time.perf_counter() - self._start, 3), "seed": None, "overrides": [],
                   "constants": {}, "recorded_by": "gradrepro.record", "every": self.every,
                   "versions": self._versions, "device": str(param.device) if param is not None else None}
        if self.combiner is not None:  # the processes: how many, which diverged or went non-finite
            summary.update(self.combiner.summary(), rank=self.rank)
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}"
        write_json(self.run_dir / SUMMARY, summary)

    def close(self, status: str = "completed", error: Optional[BaseException] = None) -> None:
        """Remove the hooks and write the folder: records, summary (``status``), figure. A step
        that began and was never taken (a skipped step) is dropped. Safe to call twice."""
        if self.status is not None:
            return
        for handle in self._handles:
            handle.remove()
        self._after_forward(self.model, (), None)  # a forward that raised leaves nothing set
        raised: Optional[FindingError] = None
        if self.watch is not None:
            self.watch.close()
            try:
                self.watch.settle(final=True)  # a finding held for the next forward pass, said now
            except FindingError as exc:  # on_finding="raise": after the folder is written
                raised = exc
        if self._current is not None:
            self._current.__exit__(RuntimeError, None, None)  # disarms, records nothing
            self._current = None
        self._close_row()
        self._close_last_row()
        self.status = status
        raised = raised if error is None else None  # closing on the loop's own error: that one propagates
        if not self._writes:
            if raised is not None:
                raise raised
            return
        try:
            self.records.flush()
            self._write_summary(status, error)
            try:
                plot_signals(self.records.scalars(), self.records.modules(), self.run_dir / FIGURE,
                             f"{self.name} ({self.step} steps, {status})")
            except Exception as exc:  # noqa: BLE001 - a figure never costs the records
                log.warning("could not draw %s: %s", FIGURE, exc)
        finally:
            release(self.run_dir)
        if raised is not None:
            raise raised

    def _close_last_row(self) -> None:
        """The last step taken, when the schedule did not log it: its scalars (``rec.log``
        values, lr, loss scale) get a row, as the built-in runs log their last step. Its
        per-module columns need the gradients before the update: pass ``steps=`` for those."""
        row, self._last_row = self._last_row, None
        if row is None or row["step"] != self.step - 1:
            return
        scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0  # read once, at the end
        step, lr = row.pop("step"), row.pop("lr")
        self.records.add_scalars({"step": step, "loss": math.nan, "lr": lr, "loss_scale": scale,
                                  **{k: _number(v) for k, v in row.items()}})

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "completed" if exc_type is None else (
            "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")
        self.close(status, exc)

    def findings(self) -> list[Finding]:
        """Per parameter over the logged steps so far: no gradient, zero, tiny, non-finite,
        not updated (``watch.over_steps``); frozen and outside-the-optimizer tensors named; a
        clip applied before a GradScaler's unscale (``diagnose.scaled_clip``); then the live
        findings (``watch.watcher``) of other kinds or tensors, each with its step."""
        if self.probe is None:  # a lazy model that never ran forward
            live = self.watch.found if self.watch is not None else []
            return list(live) or [Finding("no_findings", "(all parameters)", "no findings: no step has been "
                                          "logged yet, so there is nothing to judge", severity=INFO)]
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]} if self.optimizer else None
        frozen = [n for n, p in zip(self.probe.names, self.probe.params) if not p.requires_grad]
        outside = [n for n, p in zip(self.probe.names, self.probe.params)
                   if p.requires_grad and held is not None and id(p) not in held]
        lrs = ({id(p): float(g.get("lr", math.nan)) for g in self.optimizer.param_groups for p in g["params"]}
               if self.optimizer else {})
        updates = {n: (lrs.get(id(p), math.nan), p.dtype) for n, p in zip(self.probe.names, self.probe.params)}
        over = self._states.findings(frozen, outside, updates)
        clip = clipped_while_scaled(self.records.scalars())  # a clip before the scaler's unscale
        over = ([clip] if clip is not None else []) + over
        seen = {(f.kind, f.name) for f in over}  # summarised over the steps: they stand for the live ones
        live = self.watch.found if self.watch is not None else []
        found = over + [f for f in live if (f.kind, f.name) not in seen]
        if found:
            return found
        # Said, not left blank: ``print(*rec.findings())`` on a healthy model prints this line.
        logged = len(self._states.steps)
        detail = (f"no findings over {logged} logged step(s): no parameter lacked a gradient or had a zero, tiny "
                  "or non-finite one, and every one was updated" if logged
                  else "no findings: no step has been logged yet, so there is nothing to judge")
        return [Finding("no_findings", "(all parameters)", detail, severity=INFO)]


def record(model: nn.Module, optimizer: Any, run_dir: str | Path,
           every: Optional[int] = None, options: Optional[RecordOptions] = None, **changes: Any) -> Recorder:
    """Record ``model``'s gradient signals in your own loop into ``run_dir`` (module docstring).
    ``optimizer``: the one that updates the model, a list of those that step in turn after each
    backward (Muon and AdamW; ``watch.optimizers``), or None with ``hooks=False``.

    The options are ``RecordOptions``' fields, given as keywords (``every=16, on_finding="log"``)
    or as one ``RecordOptions`` (``options=``; keywords given beside it replace its fields).
    A folder that holds a run, or that another recording holds, is refused (UserError)."""
    if every is not None:
        changes["every"] = every
    return Recorder(model, optimizer, run_dir, options, **changes)


def _check(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise UserError("optimizer must be a torch.optim.Optimizer, a list of them, or None, "
                        f"not {type(optimizer).__name__}")
    if not any(True for _ in model.parameters()):
        raise UserError(f"{type(model).__name__} has no registered parameters: nothing to record")


def _check_optimizer_of(model: nn.Module, optimizer: Any) -> None:
    """An optimizer none of whose tensors is the model's was built over another model (checked
    after the folder's claim, so that a folder in use is said first)."""
    held = [p for g in getattr(optimizer, "param_groups", None) or [] for p in g.get("params", [])]
    mine = {id(p) for p in model.parameters()}
    if held and not any(id(p) in mine for p in held):
        err = UserError(f"the optimizer holds {len(held)} tensor(s) and none is a parameter of this "
                        f"{type(model).__name__} (compared by identity): it was built over another model, or before "
                        "the model was rebuilt; build it from model.parameters()")
        err.kind = "stale_optimizer_param"  # type: ignore[attr-defined]
        raise err


def _check_same_params(net: nn.Module, held: list) -> None:
    """The parameters the probe holds are still the model's: ``fully_shard`` (and
    ``load_state_dict(assign=True)``) replace them, and the probe would read stale tensors."""
    current = list(net.parameters())  # deduplicated, in the probe's order
    if len(current) != len(held) or any(a is not b for a, b in zip(current, held)):
        raise UserError("the model's parameters were replaced after gradrepro.record was attached "
                        "(sharded with fully_shard, or loaded with assign=True): create the recorder "
                        "after sharding and loading")


def _check_scalar(name: str, value: Any) -> None:
    """``rec.log`` takes numbers: a bool, int or float, a numpy number, a one-element tensor, an
    object with ``__float__``."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise UserError(f"rec.log({name}=...): a tensor of shape {tuple(value.shape)} is not one number; "
                            f"log a reduction of it ({name}=t.mean(), t.norm(), ...) or one element")
        if value.is_complex():
            raise UserError(f"rec.log({name}=...): a complex tensor is not one real number; log its abs() or real")
        return
    if isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.size == 1
                                           and np.issubdtype(value.dtype, np.number)):
        return
    if hasattr(type(value), "__float__") and not isinstance(value, (str, bytes, complex)):
        return  # a number of its own kind, read (float()) only if its step is logged
    raise UserError(f"rec.log({name}=...): {type(value).__name__} {_short(value)} is not a number; log numbers "
                    "or one-element tensors (a column of the scalars table)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Frames of these files are the recorder's and torch's own, not the caller's.
_OWN_FILES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def _caller_line() -> Optional[tuple]:
    """``(frame id, line)`` of the first frame outside torch and gradrepro: where the user's code
    called the model (from a forward hook) or ``rec.log``."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame = frame.f_back
    return None if frame is None else (id(frame), frame.f_lineno)


def _number(value: Any) -> float:
    if torch.is_tensor(value):
        return float(value.detach().float().reshape(-1)[0]) if value.numel() == 1 else math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


class _CallableModule(types.ModuleType):
    """``gradrepro.record`` is this module and the function at once: ``gradrepro.record(...)``
    calls ``record`` whether or not ``import gradrepro.record`` ran first (importing a
    submodule binds the package attribute to the module, which would shadow a function)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Recorder:
        return record(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
