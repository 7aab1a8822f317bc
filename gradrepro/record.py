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
import sys
import time
import types
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from gradrepro.diagnose.live import LiveChecks
from gradrepro.diagnose.over_steps import findings_over_steps
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
from gradrepro.records.writer import Records, flush_seconds

log = logging.getLogger(__name__)

# Columns the recorder writes itself: rec.log() may not replace them (``loss`` is the user's).
RESERVED = tuple(name for name in RUN_SCALARS if name != "loss")


class Recorder:
    """Records one model's gradient signals over a training loop (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], run_dir: str | Path,
                 every: int = 10, name: Optional[str] = None, scaler: Any = None, activations: bool = True,
                 act_sample: int = 8, hooks: bool = True, bf16: Optional[bool] = None,
                 every_rank: bool = False, timeout: float = ranks.HANDSHAKE_SECONDS,
                 eager_logged_steps: bool = False, live: bool = True, on_finding: str = "warn",
                 silence: Any = (), steps: Optional[int] = None, before_on: str = "device") -> None:
        _check(model, optimizer, every, steps)
        if before_on not in BEFORE_ON:
            raise UserError(f"before_on={before_on!r} is not valid; choose one of: {', '.join(BEFORE_ON)}")
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
            self.name = name or self.run_dir.resolve().name
            weight_decay = float(optimizer.param_groups[0].get("weight_decay", 0.0)) if optimizer else 0.0
            cfg = ProbeConfig(every=every, activations=activations, act_sample=act_sample, task_contribution=False,
                              before_on=before_on)
            self.net = unwrap(model)  # DDP's and torch.compile's wrappers: the names of the model itself
            # ``steps`` known: the last step is logged, as in the built-in runs.
            self.probe = Probe(self.net, cfg, total_steps=steps, weight_decay=weight_decay)
            self.probe.carry_at_backward = True  # a loop may zero_grad() between forward and backward
            self.combiner = ranks.attach(self.probe, timeout)
            # bf16 rounding: always, never, or (None) when a weight is bf16 or bf16 autocast is on.
            self._bf16, self._bf16_weights = bf16, has_bf16(self.probe.params)
            self.records = Records(self.run_dir)
            # findings reported at the logged step they appear (diagnose.live)
            self.live = (LiveChecks(model, optimizer, self.probe, scaler, self.run_dir, on_finding, silence)
                         if live else None)
            self.step = 0  # optimizer steps taken so far: the index of the step in progress
            self.status: Optional[str] = None  # set by close()
            self._begun = False
            self._eager, self._restore = False, None  # eager logged steps of a compiled model (below)
            self._current: Optional[ProbeStep] = None  # the logged step in progress
            self._scalars: dict[str, Any] = {}  # rec.log() values of the step in progress
            self._open_row: Optional[dict[str, Any]] = None  # the last logged step's row, open to rec.log()
            self._last_row: Optional[dict[str, Any]] = None  # the last unlogged step's scalars (read at close)
            self._start, self._last_flush, self._versions = time.perf_counter(), None, versions()
            self._handles: list = []
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
                                 optimizer.register_step_pre_hook(lambda *_: self.before_step()),
                                 optimizer.register_step_post_hook(lambda *_: self.after_step())]
            self._write_summary("running")
        except BaseException:
            if self._writes:
                release(self.run_dir)
            raise

    # -- the step protocol: called by the hooks, or by you with hooks=False ------------------
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        starts = not self._begun
        self.begin()  # while a step is in progress: only the live loss-scale check
        if starts and self._current is not None and self._bf16 is None and autocast_bf16(self.probe.params[0]):
            self.probe.bf16 = True
        if starts and self._current is not None and self._eager:
            self._restore = run_eagerly()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._restore is not None:
            self._restore, restore = None, self._restore
            restore()

    def begin(self) -> None:
        """A step begins (before its first forward pass). The last logged step's row closes."""
        if self._begun:
            if self._current is not None and self.live is not None:
                self.live.step_retried(self.step)  # a skipped step's retry, or the next micro-batch
            return
        self._close_row()
        self._begun = True
        if self.probe.logs(self.step):
            self.probe.bf16 = bool(self._bf16 if self._bf16 is not None else self._bf16_weights)
            lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else math.nan
            scale = float(self.scaler.get_scale()) if self.scaler is not None else 1.0
            self._current = self.probe.step(self.step, lr=lr, loss_scale=scale)
            self._current.__enter__()
            if self.live is not None:
                self.live.begin(self.step)

    def before_step(self) -> None:
        """The gradients are complete (after backward, unscaling and accumulation)."""
        self.begin()  # a step whose forward pass no hook saw
        if self._current is not None:
            _check_same_params(self.net, self.probe.params)
            if self.live is not None:
                self.live.before_step()
            self._current.collect()

    def after_step(self) -> None:
        """The optimizer has updated the parameters: the step ends."""
        self.begin()
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
                self._open_row = {"step": self.step, "loss": math.nan, "lr": self.probe.lr,
                                  "loss_scale": self.probe.loss_scale, **step_norms(current.columns),
                                  **{k: _number(v) for k, v in scalars.items()}}
        self.step += 1
        self._begun = False
        if current is not None and (self._last_flush is None or time.monotonic() - self._last_flush > flush_seconds()):
            self.flush()
        if current is not None and self.live is not None:
            self.live.after_step(self.step - 1, current.columns)  # last: it may raise (on_finding="raise")

    def log(self, **scalars: Any) -> None:
        """Scalars of the step in progress, or, after ``optimizer.step()``, of the step just
        taken. Numbers or one-element tensors; a tensor is read (one host sync) only when its
        step is logged. The recorder's own columns (``RESERVED``) are refused."""
        taken = sorted(set(scalars) & set(RESERVED))
        if taken:
            raise UserError(f"rec.log({', '.join(taken)}=...): reserved column(s) the recorder writes itself "
                            f"({', '.join(RESERVED)}); log under another name")
        if self._begun:
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
            self._last_flush = time.monotonic()
            return
        try:
            self.records.flush()
            self._write_summary(self.status or "running")
        except OSError as exc:
            log.warning("could not write the records yet (%s); will try again", exc)
        self._last_flush = time.monotonic()

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
        if self.live is not None:
            self.live.disarm()
        if self._current is not None:
            self._current.__exit__(RuntimeError, None, None)  # disarms, records nothing
            self._current = None
        self._close_row()
        self._close_last_row()
        self.status = status
        if not self._writes:
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
        not updated (``diagnose.over_steps``); frozen and outside-the-optimizer tensors named; a
        clip applied before a GradScaler's unscale (``diagnose.scaled_clip``); then the live
        findings (``diagnose.live``) of other kinds or tensors, each with its step."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]} if self.optimizer else None
        frozen = [n for n, p in zip(self.probe.names, self.probe.params) if not p.requires_grad]
        outside = [n for n, p in zip(self.probe.names, self.probe.params)
                   if p.requires_grad and held is not None and id(p) not in held]
        modules = self.records.modules()
        lrs = ({id(p): float(g.get("lr", math.nan)) for g in self.optimizer.param_groups for p in g["params"]}
               if self.optimizer else {})
        updates = {n: (lrs.get(id(p), math.nan), p.dtype) for n, p in zip(self.probe.names, self.probe.params)}
        over = findings_over_steps(modules, frozen, outside, updates) if "grad_state" in modules else []
        clip = clipped_while_scaled(self.records.scalars())  # a clip before the scaler's unscale
        over = ([clip] if clip is not None else []) + over
        seen = {(f.kind, f.name) for f in over}  # summarised over the steps: they stand for the live ones
        live = self.live.found if self.live is not None else []
        found = over + [f for f in live if (f.kind, f.name) not in seen]
        if found:
            return found
        # Said, not left blank: ``print(*rec.findings())`` on a healthy model prints this line.
        logged = int(modules["step"].nunique()) if "step" in modules else 0
        detail = (f"no findings over {logged} logged step(s): no parameter lacked a gradient or had a zero, tiny "
                  "or non-finite one, and every one was updated" if logged
                  else "no findings: no step has been logged yet, so there is nothing to judge")
        return [Finding("no_findings", "(all parameters)", detail, severity=INFO)]


def record(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], run_dir: str | Path, every: int = 10,
           **options: Any) -> Recorder:
    """Record ``model``'s gradient signals in your own loop into ``run_dir`` (module docstring).
    ``options``: ``name`` (the run's name, default the folder's), ``scaler`` (a GradScaler: its
    scale is recorded as ``loss_scale``), ``activations``, ``act_sample``, ``hooks``, ``bf16``
    (count the updates bf16 weights round away: None = when a weight is bf16 or under bf16
    autocast), ``every_rank`` (each process writes ``<run_dir>-rank<r>``), ``timeout`` (seconds
    the first logged step waits for every process's recorder), ``eager_logged_steps`` (a
    compiled model's logged steps run uncompiled, so that its activations are recorded);
    ``live`` (check findings on every logged step, default True), ``on_finding`` ("warn",
    "raise" or "log") and ``silence`` (kinds not reported): see ``gradrepro.diagnose.live``;
    ``steps`` (the number of steps the loop will take: the last one is then logged in full);
    ``before_on`` ("device" or "host": where the copy of the parameters taken before each logged
    step's optimizer step lives; "host" keeps it off the GPU, ``probe.config.ProbeConfig``).
    A folder that holds a run, or that another recording holds, is refused (UserError)."""
    return Recorder(model, optimizer, run_dir, every, **options)


def _check(model: Any, optimizer: Any, every: Any, steps: Any = None) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise UserError(f"optimizer must be a torch.optim.Optimizer (or None), not {type(optimizer).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"every={every!r} must be a whole number of steps >= 1")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UserError(f"steps={steps!r} must be the whole number of steps the loop takes (>= 1), or None")
    if not any(True for _ in model.parameters()):
        raise UserError(f"{type(model).__name__} has no registered parameters: nothing to record")


def _check_same_params(net: nn.Module, held: list) -> None:
    """The parameters the probe holds are still the model's: ``fully_shard`` (and
    ``load_state_dict(assign=True)``) replace them, and the probe would read stale tensors."""
    current = list(net.parameters())  # deduplicated, in the probe's order
    if len(current) != len(held) or any(a is not b for a, b in zip(current, held)):
        raise UserError("the model's parameters were replaced after gradrepro.record was attached "
                        "(sharded with fully_shard, or loaded with assign=True): create the recorder "
                        "after sharding and loading")


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
