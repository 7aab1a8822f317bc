"""The transition ``diagnose`` makes: one fresh loss from the closure, backward, every
gradient classified with the probe's own rule (``probe.states.grad_states``), a test of which
gradient-less parameters the loss depends on, and one optimizer step whose change of every
parameter is predicted from its gradient and the optimizer's state (``update_rule``).

Everything is put back afterwards: every ``.grad`` (None stays None; a stale gradient stays,
so the report does not hide it) and the registered buffers; with a step, the parameters and
the optimizer's state keep exactly that one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from gradrepro.diagnose.inputs import DiagnoseValueError, check_loss
from gradrepro.diagnose.registration import Row, optimizer_members, scan_attributes
from gradrepro.diagnose.update_rule import SUPPORTED, predict, rule_name, snapshot_state
from gradrepro.probe.states import FP16_FLUSH, grad_states

_Array = Optional[np.ndarray]


@dataclass
class Transition:
    """What one transition found, tensor by tensor (arrays in ``rows`` order)."""

    rows: list[Row]
    members: dict[int, tuple[int, dict]]  # id(tensor) -> (param group index, param group)
    grads_before: list  # .grad as it was before the call
    before: list[torch.Tensor]  # the parameters before the step
    nonleaf: list[tuple[str, torch.Tensor]]
    loss_value: float = math.nan
    graph: bool = True  # the loss had a graph
    inference: bool = False  # the loss was computed under torch.inference_mode()
    notes: list[str] = field(default_factory=list)
    # -- after backward (``_classify``)
    grads: list = field(default_factory=list)
    has: _Array = None
    g_norm: _Array = None
    p_norm: _Array = None
    nonzero: _Array = None
    nonfinite: _Array = None
    numel: _Array = None
    g_to_p: _Array = None
    flush: _Array = None  # share of non-zero entries fp16 flushes to zero
    registered: _Array = None
    requires: _Array = None
    state: _Array = None  # gradient states (probe.states)
    median: float = math.nan  # the registered tensors' median grad/param ratio
    depends: list = field(default_factory=list)  # does the loss depend on it: bool | None
    # -- after the step (``_step_and_predict``)
    stepped: bool = False
    rule: Optional[str] = None
    changed: _Array = None
    update_norm: _Array = None
    expected: _Array = None  # the norm of the predicted change
    rel_err: _Array = None
    matches: _Array = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [r.tensor for r in self.rows]


def _norm(t: torch.Tensor | None) -> float:
    return math.nan if t is None else float(torch.linalg.vector_norm(t.detach().to(torch.float64)))


def _loss_value(closure: Callable[[], Any], seed: int) -> float:
    torch.manual_seed(seed)
    out = closure()
    return float(out.detach().double()) if isinstance(out, torch.Tensor) and out.numel() == 1 else math.nan


def _loss_depends(closure: Callable[[], Any], tensor: torch.Tensor, seed: int = 0) -> bool | None:
    """Does the loss change when ``tensor`` is nudged? None when the closure is not
    deterministic under a fixed seed. The tensor is restored bit for bit."""
    saved = tensor.detach().clone()
    with torch.no_grad(), torch.random.fork_rng():
        base = _loss_value(closure, seed)
        if base != _loss_value(closure, seed):  # NaN or a closure that draws new data
            return None
        rms = float(saved.double().pow(2).mean().sqrt()) if saved.numel() else 0.0
        direction = torch.randn(saved.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        try:
            tensor.add_((0.01 * (rms if rms > 0 else 1.0) * direction).to(tensor.dtype).to(tensor.device))
            moved = _loss_value(closure, seed)
        finally:
            tensor.copy_(saved)
    return moved != base


def run_transition(model: nn.Module, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor],
                   rows: list[Row], nonleaf: list[tuple[str, torch.Tensor]], step: bool, tiny_factor: float,
                   rtol: float, probe_paths: bool) -> Transition:
    """The transition, with every ``.grad`` and buffer put back as it was (module docstring)."""
    tensors = [r.tensor for r in rows]
    tr = Transition(rows, optimizer_members(optimizer), [t.grad for t in tensors],
                    [t.detach().clone() for t in tensors], nonleaf)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for t in tensors:
            t.grad = None
        loss = _fresh_loss(closure, tensors)
        tr.loss_value = float(loss.detach().double())
        tr.graph = loss.requires_grad
        tr.inference = loss.is_inference()
        if tr.graph:
            _backward(loss)
        _, nonleaf_after = scan_attributes(model, {id(t) for t in tensors} | {id(b) for b, _ in buffers})
        for path, t in nonleaf_after:
            if all(path != p for p, _ in tr.nonleaf):
                tr.nonleaf.append((path, t))
        _classify(tr, tiny_factor)
        tr.depends = [None] * len(rows)
        for i, r in enumerate(rows):
            if tr.graph and probe_paths and r.registered and tr.requires[i] and not tr.has[i]:
                tr.depends[i] = _loss_depends(closure, r.tensor)
        for b, saved in buffers:  # the extra forward passes may have moved batch-norm statistics
            b.copy_(saved)
        _step_and_predict(tr, optimizer, step, rtol)
    finally:
        for t, g in zip(tensors, tr.grads_before):
            t.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return tr


def _fresh_loss(closure: Callable[[], torch.Tensor], tensors: list[torch.Tensor]) -> torch.Tensor:
    with torch.enable_grad():
        loss = check_loss(closure())
    if any(t.grad is not None for t in tensors):
        raise DiagnoseValueError(
            "the closure ran backward() itself (gradients appeared while it ran); pass a closure that "
            "only computes and returns the loss: diagnose runs zero_grad and backward")
    return loss


def _backward(loss: torch.Tensor) -> None:
    try:
        loss.backward()
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise DiagnoseValueError(
            f"backward through the closure's loss failed: {first} (the closure must compute a fresh "
            "loss on every call; a loss computed once outside it loses its graph at its first backward)"
        ) from None


def _classify(tr: Transition, tiny_factor: float) -> None:
    """Every gradient's statistics and state; registered tensors are judged among themselves,
    as the probe (which sees registered tensors only) judges them."""
    tensors = tr.tensors
    grads = [t.grad for t in tensors]
    has = np.array([g is not None for g in grads])
    g_norm = np.array([_norm(g) for g in grads])
    p_norm = np.array([_norm(t) for t in tr.before])
    nonzero = np.array([float(torch.count_nonzero(g)) if g is not None else 0.0 for g in grads])
    nonfinite = np.array([float((~torch.isfinite(g)).sum()) if g is not None else 0.0 for g in grads])
    small = np.array([float((g.abs() <= FP16_FLUSH).sum()) if g is not None else 0.0 for g in grads])
    numel = np.array([float(t.numel()) for t in tensors])
    with np.errstate(divide="ignore", invalid="ignore"):
        g_to_p = g_norm / np.where(p_norm > 0, p_norm, np.nan)
        flush = np.where(nonzero > 0, (small - (numel - nonzero)) / nonzero, np.nan)
    registered = np.array([r.registered for r in tr.rows])
    state = grad_states(has, nonfinite, nonzero, g_to_p, p_norm, tiny_factor)
    if registered.any():
        state[registered] = grad_states(has[registered], nonfinite[registered], nonzero[registered],
                                        g_to_p[registered], p_norm[registered], tiny_factor)
    judged = registered & has & (nonfinite == 0) & (nonzero > 0) & (p_norm > 0) & np.isfinite(g_to_p)
    tr.median = float(np.median(g_to_p[judged])) if judged.any() else math.nan
    tr.grads, tr.state, tr.has, tr.g_norm, tr.p_norm = grads, state, has, g_norm, p_norm
    tr.nonzero, tr.nonfinite, tr.numel, tr.g_to_p, tr.flush = nonzero, nonfinite, numel, g_to_p, flush
    tr.registered, tr.requires = registered, np.array([t.requires_grad for t in tensors])


def _step_and_predict(tr: Transition, optimizer: torch.optim.Optimizer, step: bool, rtol: float) -> None:
    """One optimizer step, and every parameter's change against the one its rule predicts."""
    tensors, members, grads, n = tr.tensors, tr.members, tr.grads, len(tr.rows)
    states_before = {i: snapshot_state(optimizer, tensors[i]) for i in range(n)
                     if id(tensors[i]) in members and grads[i] is not None}
    if step and tr.graph:
        try:
            optimizer.step()
        except Exception as exc:  # noqa: BLE001 - any optimizer's failure becomes one clear line
            raise DiagnoseValueError(
                f"optimizer.step() failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__} "
                "(an optimizer whose step needs a closure, such as LBFGS, is not supported; use step=False)"
            ) from None
        tr.stepped = True
    tr.rule = rule_name(optimizer)
    if tr.rule is None:
        tr.notes.append(f"update check skipped: no rule for {type(optimizer).__name__} (supported: {SUPPORTED})")
    changed = np.zeros(n, dtype=bool)
    update_norm = np.full(n, math.nan)
    expected = np.full(n, math.nan)
    rel_err = np.full(n, math.nan)
    matches = np.ones(n, dtype=bool)
    for i, t in enumerate(tensors):
        after, before = t.detach(), tr.before[i]
        changed[i] = not torch.equal(after, before)
        update_norm[i] = _norm(after.double() - before.double())
        if not tr.stepped or id(t) not in members or grads[i] is None:
            expected[i] = 0.0  # the optimizer skips a None gradient; a non-member is never touched
            matches[i] = not changed[i]
            rel_err[i] = 0.0 if not changed[i] else math.inf
            continue
        predicted = predict(optimizer, members[id(t)][1], before, grads[i], states_before[i])
        if predicted is None:
            continue
        expected[i] = _norm(predicted - before.double())
        err = _norm(after.double() - predicted)
        floor = 2 * torch.finfo(t.dtype).eps * _norm(after) if t.is_floating_point() else 0.0
        matches[i] = err <= rtol * expected[i] + floor
        rel_err[i] = err / expected[i] if expected[i] > 0 else (0.0 if err == 0 else math.inf)
    tr.changed, tr.update_norm, tr.expected, tr.rel_err, tr.matches = changed, update_norm, expected, rel_err, matches


def group_lr(member: tuple[int, dict] | None) -> float:
    """The learning rate of a tensor's param group (NaN outside the optimizer)."""
    if member is None:
        return math.nan
    lr = member[1].get("lr", math.nan)
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)
