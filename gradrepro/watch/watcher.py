"""Findings as they happen: what ``gradrepro.record`` checks on every logged step, reported once,
at the step it first appears, with the tensor or module, the step's numbers and the next check.

    rec = gradrepro.record(model, optimizer, "runs/mine", every=16)            # warns (TrainingFinding)
    rec = gradrepro.record(..., on_finding="raise")                            # raises FindingError
    rec = gradrepro.record(..., silence=["eval_mode"])                         # one kind left out

A finding goes to Python's ``warnings`` (category ``TrainingFinding``; ``on_finding="log"``:
the ``gradrepro.watch.watcher`` logger instead), to ``findings.json`` in the run folder
(written atomically when it appears) and to ``rec.findings()``.

The invariants of a training step (``watch.invariants``: weights changed between steps,
frozen tensors that move, gradients reset inside a step; ``watch.carried``: stale gradients on
every step; ``watch.rule_check``: the update against its rule) are wired in here. Cost: on a
step that is not logged, the fingerprints (``invariants``) and at most 8 gradient hooks
(``carried``). On a logged step, besides the probe's own work:
identity sets of the optimizer's and the model's tensors, one pass over the mode-sensitive
modules, a copy of each frozen BatchNorm's running mean, a forward hook on the model and a
gradient hook on its output, where a few multi-tensor operations (a difference and norms)
read the gradients when backward begins and one multi-tensor norm when it ends
(``queue_callback`` of the autograd engine), and two transfers to the host.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from gradrepro.diagnose.report import ERROR, INFO, NEXT_CHECK, WARNING, Finding
from gradrepro.diagnose.severity import PERSIST_STEPS
from gradrepro.errors import UserError
from gradrepro.probe.shards import local
from gradrepro.records.files import write_json
from gradrepro.watch import checks, invariants
from gradrepro.watch.carried import CarriedGradients
from gradrepro.watch.rule_check import UpdateRuleCheck

log = logging.getLogger(__name__)

FINDINGS = "findings.json"
ON_FINDING = ("warn", "raise", "log")
# Every kind the live checks report, with its severity.
# ``no_gradient`` of one tensor and ``lr_zero`` are patterns healthy loops show for a while (an
# expert without tokens, a group held at lr 0): information when they appear, and a warning
# once they have held at every one of PERSIST_STEPS logged steps in a row (``severity``).
# ``no_gradient`` of the whole model (the loss does not reach it) is an error at once.
KINDS: dict[str, str] = {
    "not_in_optimizer": ERROR, "stale_optimizer_param": ERROR, "lr_zero": INFO, "not_updated": ERROR,
    "no_gradient": INFO, "grad_modified": ERROR, "nonfinite_gradient": ERROR, "stale_gradient": ERROR,
    "eval_mode": WARNING, "frozen_norm_drift": WARNING, "loss_scale_backoff": ERROR, "unregistered": WARNING,
    "repeated_module": WARNING, "freeze_noop": WARNING, "scaled_step": ERROR, "dropout_all": WARNING,
    "norm_momentum": WARNING, "optimizer_attribute": WARNING,
}
KINDS.update(invariants.KINDS)  # the step's invariants (watch.invariants, watch.rule_check)
KINDS["update_mismatch"] = WARNING
NEXT_CHECK.update(invariants.NEXT_CHECK)
NEXT_CHECK.update({
    "repeated_module": "build each place with its own call: nn.ModuleList([Block() for _ in range(n)]), not "
    "[Block()] * n; to share weights on purpose, keep one module and call it in a loop",
    "scaled_step": "step through the scaler: scaler.step(optimizer) then scaler.update() (or call "
    "scaler.unscale_(optimizer) before optimizer.step())",
    "dropout_all": "give the dropout its rate (nn.Dropout(p=0.1)); a flag that turns dropout on or off chooses "
    "whether to build the module, not its p",
    "norm_momentum": "PyTorch's momentum is the weight of the new batch: 1 - (TensorFlow's momentum), e.g. 0.01 "
    "for TensorFlow's 0.99",
    "optimizer_attribute": "set it in every param group: for g in optimizer.param_groups: g['lr'] = new_lr (or use a "
    "torch.optim.lr_scheduler)",
    "freeze_noop": "module.requires_grad_(False), or p.requires_grad_(False) for p in module.parameters(), before "
    "the optimizer is built (or leave its parameters out of the optimizer)",
})
PERSISTING = ("no_gradient", "lr_zero")
_PERSISTED = {
    "no_gradient": "the loss does not use it: an auxiliary head or branch left out of the loss? Nothing to fix if on "
                   "purpose; DistributedDataParallel then needs find_unused_parameters=True",
    "lr_zero": "its param group is held at learning rate 0: it does not train",
}
# GradScaler halves its scale on every step with an overflow (torch.amp.GradScaler docs,
# backoff_factor=0.5). Below a scale of 1 it shrinks the gradients instead of amplifying
# them, so an overflow there is not one the scale caused: the backoff will not end.
SCALE_FLOOR = 1.0


class TrainingFinding(UserWarning):
    """The warning category of a live finding (filter it with ``warnings.filterwarnings``)."""


class FindingError(RuntimeError):
    """Raised by the recorder with ``on_finding="raise"``; ``.findings`` holds what was found."""

    def __init__(self, findings: list["LiveFinding"]) -> None:
        super().__init__("\n".join(str(f) for f in findings))
        self.findings = findings


@dataclass(frozen=True)
class LiveFinding(Finding):
    step: int = -1
    evidence: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def fix(self) -> str:
        return NEXT_CHECK.get(self.kind, "")

    def __str__(self) -> str:
        return f"[{self.severity}] step {self.step}: {self.kind} {self.name}: {self.detail}\n  next check: {self.fix}"

    def row(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "name": self.name, "severity": self.severity,
                "detail": self.detail, "fix": self.fix, "evidence": self.evidence}


def check_options(on_finding: str, silence: Any) -> list[str]:
    """The options' values checked (one line each): the kinds ``silence`` names, as a list."""
    if on_finding not in ON_FINDING:
        raise UserError(f"on_finding={on_finding!r}: choose one of {', '.join(ON_FINDING)}")
    silence = [silence] if isinstance(silence, str) else list(silence)
    unknown = [k for k in silence if k not in KINDS]
    if unknown:
        raise UserError(f"silence={unknown[0]!r} is not a finding; the findings are: {', '.join(KINDS)}")
    return silence


class Watch:
    """The recorder's live findings; the recorder calls ``begin`` (a logged step begins),
    ``before_step``, ``after_step`` (with the probe's columns) and ``step_retried``."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], probe: Any, scaler: Any,
                 run_dir: Path, on_finding: str = "warn", silence: Any = ()) -> None:
        silence = check_options(on_finding, silence)
        self.model, self.optimizer, self.probe, self.scaler = model, optimizer, probe, scaler
        self.path, self.on_finding, self.silence = Path(run_dir) / FINDINGS, on_finding, set(silence)
        self.found: list[LiveFinding] = []
        self._seen: set[tuple[str, str, str]] = set()  # (kind, name, severity) reported
        self._runs: dict[tuple[str, str], int] = {}  # (kind, name) -> logged steps in a row it held
        self._sensitive = checks.mode_sensitive(model)
        self._sensitive += invariants.training_readers(model, self._sensitive)
        self.invariants = invariants.StepInvariants(probe.names, probe.params, optimizer)
        self.trail = invariants.BackwardTrail(probe.names, probe.params, self.invariants.prints)
        self.carried = CarriedGradients(probe.names, probe.params, optimizer)  # stale_gradient between logged steps
        self.rule = UpdateRuleCheck(probe.names, probe.params, self.invariants.prints, optimizer)
        self._hits: list[checks.Hit] = []  # found before the step, reported after it
        self.at_step = True  # before_step runs in the optimizer's step pre-hook (False: called by hand, Lightning)
        self._unregistered: Optional[set] = None  # ids of tensors held unregistered (the first logged step's scan)
        self._held: Optional[tuple] = None  # (step, hit): no gradient at the step, said at the next pass (_hold)
        self._late: Optional[str] = None  # the first tensor a backward after that step reached
        self._late_handles: list = []
        self._watched: list[tuple[str, nn.Module]] = []
        self._means: list[torch.Tensor] = []
        self._handles: list = []
        self._start: Optional[tuple] = None  # (indices, carried norms, differences) at the last backward's start
        self._marks: dict = {}  # parameter index -> (weak reference to its .grad, version) at the step's start
        self._end: Optional[tuple] = None  # (indices, norms) when the last backward ended
        self._scale: Optional[float] = None
        self._in_backward = False

    # -- the step protocol ------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A logged step begins (before its first forward pass)."""
        self._hits, self._start, self._end, self._in_backward = [], None, None, False
        self.trail.reset_step()
        # What .grad holds as the step begins, by identity and in-place version (weakly: a
        # loop that sets .grad to None frees it): a backward that starts on the very same,
        # unmodified tensor accumulates onto a gradient nothing reset.
        self._marks = {i: (weakref.ref(p.grad), p.grad._version)
                       for i, p in enumerate(self.probe.params) if p.grad is not None}
        self._watched = checks.drifting_norms(self._sensitive)
        self._means = [m.running_mean.detach().clone() for _, m in self._watched]
        self._handles.append(self.model.register_forward_hook(self._on_output))
        self._check_scale(step, float(self.probe.loss_scale))

    def step_retried(self, step: int) -> None:
        """A forward pass began while a logged step was in progress: with a GradScaler, the
        step may have been skipped (its scale backed off)."""
        if self.scaler is not None:
            self._check_scale(step, float(self.scaler.get_scale()))

    # -- on every step, logged or not: the fingerprints (watch.invariants) ------------------
    def each_begin(self, step: int, logged: bool) -> None:
        """A step begins (its first forward pass, or ``rec.begin()``)."""
        self.settle()
        self.invariants.step_begins(step)
        self.carried.forward(first=True)
        self._report_invariants(logged)

    def each_forward_again(self, step: int, logged: bool, every: int) -> None:
        """A training forward pass inside the step in progress (``invariants.forward_again``)."""
        self.invariants.forward_again(step, max(every, 2))
        self.carried.forward(first=False)
        self._report_invariants(logged)

    def each_before_step(self) -> None:
        self.invariants.before_step()

    def each_after_step(self, step: int, logged: bool) -> None:
        self.invariants.after_step(step)
        self.carried.step_taken(step)
        self._report_invariants(logged)

    def _report_invariants(self, logged: bool) -> None:
        by_step: dict[int, list] = {}
        for step, hit in self.invariants.hits(logged) + self.carried.hits(logged):
            by_step.setdefault(step, []).append(hit)
        for step in sorted(by_step):  # the earliest first: a finding is said once, at its first step
            self._report(step, [(KINDS[hit[0]], hit) for hit in by_step[step]])

    def recorder_failed(self, step: int, exc: BaseException, where: str) -> None:
        """The recorder's own failure, as one ``recorder_error`` finding."""
        hit = invariants.recorder_error_hit(exc, where)
        self._report(step, [(KINDS[hit[0]], hit)])

    def before_step(self) -> None:
        """The gradients are complete; the probe has not read them yet."""
        # A stale gradient is one the step uses: where .grad is no longer the tensor it held when
        # the step began (set to None and assigned anew: gradients made by autograd.grad and put
        # in .grad by hand, as per-sample clipping does), the backward passes did not sum into it.
        # Where no tensor had a .grad when the step began, nothing was carried in: a gradient found
        # at the first backward the trail saw was made in this step (a backward run inside the
        # forward pass, as local learning's per-stage losses do).
        params = self.probe.params
        still = {i for i, (ref, _) in self._marks.items() if ref() is not None and ref() is params[i].grad}
        self.trail.stop(carried_used=bool(still))
        if self._start is not None:
            idx, carried, diff = self._start
            keep = [k for k, i in enumerate(idx) if i in still]
            self._start = ([idx[k] for k in keep], [carried[k] for k in keep], [diff[k] for k in keep]) if keep \
                else None
        self.rule.predict()
        if self._unregistered is None:  # once, at the first logged step: after a forward pass made any lazy attribute
            hits, self._unregistered = checks.registration_hits(self.model, self.optimizer)
            self._hits += hits + checks.structure_hits(self.model)
        self._hits += checks.membership_hits(self.model, self.optimizer, self._unregistered)
        self._hits += checks.setting_hits(self.optimizer)
        if self.at_step:  # inside optimizer.step() (its pre-hook), not a caller's hook before it (a scaler's step)
            self._hits += checks.scaled_step_hits(self.scaler, self.optimizer)
        self._hits += checks.mode_hits(self.model, self._sensitive)
        self._hits += checks.drift_hits(self._watched, self._means)

    def after_step(self, step: int, columns: Optional[dict]) -> None:
        """The step is taken: its columns are made. Reports what is new."""
        self.disarm()
        hits, self._hits = self._hits + self.rule.compare(step), []
        if columns is not None:
            names, params = self.probe.names, self.probe.params
            end = self._host(self._end)
            hits += checks.column_hits(step, names, params, columns, checks.group_lrs(self.optimizer), end)
            if self._start is not None:
                idx, carried, diff = self._start
                values = torch.stack([torch.stack(carried), torch.stack(diff)]).cpu().double().numpy()
                hits += checks.stale_hits(names, zip(idx, values[0], values[1]))
        kinds = {(h[0], h[1]) for h in hits}
        hits += [h for h in self.trail.found if (h[0], h[1]) not in kinds]  # one finding of a kind and name
        if step == 0:  # a linear warm-up from 0 takes its first step at lr 0 by design
            hits = [h for h in hits if h[0] != "lr_zero"]
        whole = [h for h in hits if (h[0], h[1]) == ("no_gradient", "<model>")]
        if whole and self._held is None:  # said at the next forward pass, once it is known what came after
            hits.remove(whole[0])
            self._hold(step, whole[0])
        self._report(step, self._persistence(hits, _every_lr_zero(self.optimizer)))

    # -- no gradient at the step, a backward after it: the step runs before its backward -------
    def _hold(self, step: int, hit: checks.Hit) -> None:
        """No trainable tensor had a gradient at this step. Whether a backward pass reaches
        the model after the step and before the next forward pass decides the cause: then the
        step runs before the backward that should feed it, and the next ``zero_grad()`` resets
        that backward's gradient before any step reads it (a ``grad_reset_in_step``); otherwise
        the loss does not reach the model. One hook per trainable tensor until the next pass."""
        self._held, self._late = (step, hit), None
        for i, p in enumerate(self.probe.params):
            if p.requires_grad:
                self._late_handles.append(p.register_hook(self._late_gradient(i)))

    def _late_gradient(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            if self._late is None:
                self._late = self.probe.names[i]
        return hook

    def settle(self, final: bool = False) -> None:
        """Say what was held (``_hold``): at the next forward pass, or at the end (``final``,
        where what the per-step checks left on an accelerator's device is read too)."""
        if final:
            self._report_invariants(logged=True)
        if self._held is None:
            return
        for handle in self._late_handles:
            handle.remove()
        self._late_handles.clear()
        (step, hit), self._held = self._held, None
        if self._late is not None:
            hit = ("grad_reset_in_step", "<model>", (
                f"no trainable tensor had a gradient at optimizer.step() of step {step}, and a backward pass reached "
                f"the model after that step ({self._late} first) and before the next forward pass: the step runs "
                "before the backward that should feed it, and the next zero_grad() resets that backward's gradient "
                "before any step reads it; call loss.backward() before optimizer.step()"),
                {"tensors_without_grad": hit[3].get("tensors_without_grad", 0)})
        self._report(step, self._persistence([hit]))

    def _persistence(self, hits: list[checks.Hit], every_lr_zero: bool = False) -> list[tuple[str, checks.Hit]]:
        """Each hit with its severity: a pattern of ``PERSISTING`` is information until it has
        held at ``PERSIST_STEPS`` logged steps in a row, then a warning (said once more). A
        learning rate of 0 in every param group is a warning at once: nothing trains."""
        held = {(h[0], h[1]) for h in hits if h[0] in PERSISTING}
        self._runs = {key: self._runs.get(key, 0) + 1 for key in held}
        out = []
        for hit in hits:
            kind, name, detail, evidence = hit
            severity = ERROR if (kind, name) == ("no_gradient", "<model>") else KINDS[kind]
            run = self._runs.get((kind, name), 0)
            if kind == "lr_zero" and every_lr_zero:
                severity = WARNING
                detail += "; every param group's learning rate is 0: nothing trains"
            elif kind in PERSISTING and name != "<model>":
                if run >= PERSIST_STEPS:
                    severity = WARNING
                    detail += f"; at {run} logged steps in a row: {_PERSISTED[kind]}"
                    evidence = {**evidence, "logged_steps_in_a_row": run}
                else:
                    detail += (f" (information until it holds at {PERSIST_STEPS} logged steps in a row: healthy loops "
                               "show it for a while)")
            out.append((severity, (kind, name, detail, evidence)))
        return out

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        """The recorder stops: every hook removed, the per-step ones included."""
        self.disarm()
        self.carried.close()

    # -- gradients around backward (logged steps only) ---------------------------------------
    def _on_output(self, module: nn.Module, args: Any, out: Any) -> None:
        # Every output that carries a gradient, not only the first: the loss may weigh several
        # (a segmentation model's auxiliary head, a detection model's dict of losses), and
        # autograd reaches the one made last first, filling its branch's .grad before the
        # first output's gradient exists. The first hook to fire in a backward is its start.
        # An input that carries a gradient: this pass's backward flows on into a network upstream
        # (a GAN's generator under the recorded discriminator), which it may be run for.
        upstream = any(torch.is_tensor(t) and t.requires_grad for t in tree_flatten(args)[0])
        for t in {id(t): t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.requires_grad}.values():
            t.register_hook(functools.partial(self._backward_begins, upstream=upstream))

    def _trail(self, moment: str, *args: Any) -> None:
        """The backward trail's hook, which must never raise into the user's backward: a failure
        stops it for the step and becomes a recorder_error finding."""
        try:
            getattr(self.trail, moment)(*args)
        except Exception as exc:  # noqa: BLE001 - inside autograd: reported, never raised
            self.trail.halt()
            self._hits.append(invariants.recorder_error_hit(exc, f"the backward hook ({moment})"))

    def _backward_begins(self, grad: torch.Tensor, upstream: bool = False) -> None:
        """The gradient reached one of the model's outputs, the first in this backward (the
        others return at once): .grad holds what earlier backward passes left."""
        if self._in_backward:
            return None
        self._trail("begins", upstream)
        params, self._start = self.probe.params, None
        # Untouched since the step began: the same tensor (not set to None and rebuilt) at the
        # same version (not zeroed or written in place). Its difference from then is exactly 0.
        idx = [i for i, (ref, version) in self._marks.items()
               if ref() is not None and ref() is params[i].grad and params[i].grad._version == version]
        if idx:
            with torch.no_grad():
                norms = list(torch._foreach_norm([p_grad(params[i]) for i in idx]))
            self._start = (idx, norms, [torch.zeros_like(n) for n in norms])
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
            self._in_backward = True
        except (AttributeError, RuntimeError):  # no engine callback: the edit check is skipped
            pass
        return None

    def _backward_ends(self) -> None:
        self._in_backward = False
        idx = [i for i, p in enumerate(self.probe.params) if p.grad is not None]
        with torch.no_grad():
            self._end = (idx, list(torch._foreach_norm([p_grad(self.probe.params[i]) for i in idx]))) if idx else None
        self._trail("ends", self._end or ([], []))

    @staticmethod
    def _host(end: Optional[tuple]) -> Optional[dict[int, float]]:
        if end is None:
            return None
        idx, norms = end
        values = torch.stack([n.float() for n in norms]).cpu().numpy()
        return {i: float(v) for i, v in zip(idx, values)}

    # -- the loss scale ----------------------------------------------------------------------
    def _check_scale(self, step: int, scale: float) -> None:
        if self.scaler is None:
            return
        if self._scale is not None and scale < self._scale and scale < SCALE_FLOOR:
            self._report(step, [(KINDS["loss_scale_backoff"], ("loss_scale_backoff", "<scaler>", (
                f"the GradScaler backed off to a scale of {scale:.3g} (from {self._scale:.3g}): below 1 every step "
                "still overflows, so the gradients are non-finite whatever the scale and every step is skipped"),
                {"loss_scale": scale, "previous_scale": self._scale}))])
        self._scale = scale

    # -- reporting ----------------------------------------------------------------------------
    def _report(self, step: int, hits: list[tuple[str, checks.Hit]]) -> None:
        """``hits``: (severity, hit). Each (kind, tensor) is said once per severity."""
        fresh: dict[tuple[str, str], list[checks.Hit]] = {}
        for severity, hit in hits:
            kind, name = hit[0], hit[1]
            if kind in self.silence or (kind, name, severity) in self._seen:
                continue
            self._seen.add((kind, name, severity))
            fresh.setdefault((kind, severity), []).append(hit)
        new = [_finding(step, group, severity) for (_, severity), group in fresh.items()]
        if not new:
            return
        self.found += new
        try:
            write_json(self.path, {"findings": [f.row() for f in self.found]})
        except OSError as exc:
            log.warning("could not write %s (%s)", self.path, exc)
        if self.on_finding == "raise":
            raise FindingError(new)
        for f in new:
            if self.on_finding == "log":
                log.warning("%s", f)
            else:
                warnings.warn(str(f), TrainingFinding, stacklevel=_user_level())


def _finding(step: int, group: list[checks.Hit], severity: str) -> LiveFinding:
    """One finding per kind and step: the first tensor's detail, the others named."""
    kind, name, detail, evidence = group[0]
    if len(group) > 1:
        others = [h[1] for h in group[1:]]
        detail += f"; the same for {len(others)} more: {', '.join(others[:6])}" + (" ..." if len(others) > 6 else "")
        evidence = {**evidence, "tensors": len(group)}
    return LiveFinding(kind, name, detail, severity, step=step, evidence=evidence)


def _every_lr_zero(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    if optimizer is None or not optimizer.param_groups:
        return False
    return all(float(g.get("lr", math.nan)) == 0 for g in optimizer.param_groups)


def _user_level() -> int:
    """The ``stacklevel`` that points a warning at the user's line (``optimizer.step()``, the
    forward pass): the first frame outside gradrepro and torch, counted from the caller."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("gradrepro", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def p_grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient as the probe summarises it (dense, real), and of a sharded
    (DTensor) gradient this process's shard: these checks ask whether this process's gradient
    was reset or edited, which needs no collective."""
    g = local(p.grad)
    if g.is_sparse:
        g = g.to_dense()
    return torch.view_as_real(g) if g.is_complex() else g
