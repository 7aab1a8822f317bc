"""The transition ``diagnose`` makes: one fresh loss from the closure, backward, every
gradient classified with the probe's own rule (``probe.states.grad_states``), a test of which
gradient-less parameters the loss depends on, the known causes behind missing and zero
gradients (``causes``), and one optimizer step whose change of every parameter is predicted
from the gradient the optimizer used and its state (``used_gradient``, ``update_rule``).

Everything is put back afterwards: every ``.grad`` (None stays None; a stale gradient stays,
so the report does not hide it) and the registered buffers; with a step, the parameters and
the optimizer's state keep exactly that one step.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from gradrepro.diagnose import causes, float32_check
from gradrepro.diagnose.graph import all_finite, dense, feeds_normaliser, same, wide
from gradrepro.diagnose.inputs import DiagnoseValueError, check_loss
from gradrepro.diagnose.registration import Row, optimizer_members, scan_attributes
from gradrepro.diagnose.update_rule import SUPPORTED, predict, rule_name, snapshot_state
from gradrepro.diagnose.used_gradient import Change, compare, has_tensor_hooks, loss_gradients
from gradrepro.probe.states import FP16_FLUSH, grad_states

_Array = Optional[np.ndarray]


@dataclass
class Transition:
    """What one transition found, tensor by tensor (arrays in ``rows`` order)."""

    rows: list[Row]
    members: dict[int, tuple[int, dict]]  # id(tensor) -> (param group index, param group)
    grads_before: list  # .grad as it was before the call
    before: list[torch.Tensor]  # the parameters before the call
    nonleaf: list[tuple[str, torch.Tensor]]
    loss_value: float = math.nan
    graph: bool = True  # the loss had a graph
    inference: bool = False  # the loss was computed under torch.inference_mode()
    notes: list[str] = field(default_factory=list)
    rtol: float = 1e-3  # tolerance of the update check and of "scaled by c", relative
    before_grad_norm: _Array = None  # the norms of grads_before (``findings``), taken once
    # -- after backward (``_classify``, ``_explain``)
    grads: list = field(default_factory=list)  # the loss's gradient (copies; hooks on the tensors suspended)
    after_backward: list = field(default_factory=list)  # .grad after backward (a copy where hooks could rewrite it)
    grad_versions: list = field(default_factory=list)  # version counters of the uncopied ones
    fresh_versions: list = field(default_factory=list)  # .grad's version counter after one backward (None: no .grad)
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
    zero_causes: dict = field(default_factory=dict)  # index -> indices of the zero-initialised weights in front
    feeds: dict = field(default_factory=dict)  # index -> the normalisation or softmax its operation feeds
    stochastic: set = field(default_factory=set)  # zero or missing gradients that other random draws give
    fp16: bool = False  # the loss was computed under float16 autocast
    cuts: dict = field(default_factory=dict)  # index -> the calls that cut or flatten its path
    selected: dict = field(default_factory=dict)  # index -> the selections that took none of its entries
    gated: dict = field(default_factory=dict)  # index -> the ReLU-like gates closed on all of its path
    unattenuated: dict = field(default_factory=dict)  # tiny index -> index of an ordinary gradient behind its op
    unaligned: dict = field(default_factory=dict)  # index -> its gradient's norm with random incoming directions
    read_graph: Any = None  # the loss's graph kept after backward, with the norms read there (``causes.ReadGraph``)
    loss: Any = None  # the loss, detached, where a rerun with this loss is this run again (else None)
    scratch: Any = None  # float32 buffers of the float32 arithmetic (``float32_check.Scratch``), freed at the end
    # -- around the step (``_step_and_predict``)
    at_step: list = field(default_factory=list)  # the parameters as the step found them (after forward)
    forward_changed: _Array = None  # the forward pass itself changed the parameter
    used: list = field(default_factory=list)  # .grad as the optimizer used it
    changes: list[Change] = field(default_factory=list)
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
    """The 2-norm: of a large float32 tensor in float32 where its bound puts it within a
    relative 6.2e-5 of the exact norm (``float32_check.norm``), else in float64 (a float64
    copy of the tensor)."""
    if t is None:
        return math.nan
    if float32_check.fits(t):
        value = float32_check.norm(t)
        if value is not None:
            return value
    return float(torch.linalg.vector_norm(wide(t)))


def run_transition(model: nn.Module, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor],
                   rows: list[Row], nonleaf: list[tuple[str, torch.Tensor]], step: bool, tiny_factor: float,
                   rtol: float, probe_paths: bool) -> Transition:
    """The transition, with every ``.grad`` and buffer put back as it was (module docstring)."""
    tensors = [r.tensor for r in rows]
    tr = Transition(rows, optimizer_members(optimizer), [t.grad for t in tensors],
                    [t.detach().clone() for t in tensors], nonleaf, rtol=rtol)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        for t in tensors:
            t.grad = None
        drawn = causes.random_states()
        loss, tr.fp16 = _fresh_loss(closure, tensors, model)
        drawn = not causes.same_states(drawn, causes.random_states())  # it drew random numbers (dropout, a sampler)
        tr.loss_value = float(loss.detach().double())
        if loss.grad_fn is not None:
            feeds = feeds_normaliser(loss.grad_fn)
            tr.feeds = {i: feeds[id(t)] for i, t in enumerate(tensors) if id(t) in feeds}
        tr.graph = loss.requires_grad
        tr.inference = loss.is_inference()
        unhooked = loss_gradients(loss, tensors) if tr.graph else None
        # A rerun that gives this loss bit for bit and draws no random numbers is this run again,
        # where no tensor hook sits between the graph and the gradients (``causes``).
        tr.loss = loss.detach() if tr.graph and unhooked is None and not drawn else None
        # The random-direction test of tiny gradients (``causes.unaligned_gradients``) reads the
        # gradients reaching the tensors' operations: read here, and the graph kept, where a
        # rerun of the closure can give this same graph (it drew no random numbers; checked
        # again against a rerun's loss before use) and no tensor has a hook of its own.
        handles: list = []
        if tr.loss is not None and probe_paths:
            tr.read_graph, handles = causes.watch_operations(
                loss.grad_fn, {id(t) for r, t in zip(rows, tensors) if r.registered and t.requires_grad})
        try:
            if tr.graph:
                _backward(loss, retain=tr.read_graph is not None)
        finally:
            for h in handles:
                h.remove()
        del loss
        tr.fresh_versions = [None if t.grad is None else t.grad._version for t in tensors]
        # A copy of .grad right after backward where code can still rewrite it in place before
        # the step reads it (hooks); otherwise .grad itself, its version counter checked after
        # the step: one copy of the gradients less.
        copy = unhooked is not None or grads_may_be_rewritten(optimizer)
        tr.after_backward = [None if t.grad is None else (t.grad.detach().clone() if copy else t.grad)
                             for t in tensors]
        tr.grad_versions = [None if copy or g is None else g._version for g in tr.after_backward]
        tr.grads = tr.after_backward if unhooked is None else unhooked
        _, nonleaf_after = scan_attributes(model, {id(t) for t in tensors} | {id(b) for b, _ in buffers})
        orphans = {r.orphan_of for r in rows if r.orphan_of}
        for path, t in nonleaf_after:
            if path not in orphans and all(path != p for p, _ in tr.nonleaf):
                tr.nonleaf.append((path, t))
        _classify(tr, tiny_factor)
        if not (tr.state == "tiny").any():
            tr.read_graph = None  # no tiny gradient to test: the graph's saved tensors go now
        # The reruns below see .grad as the first run did (None), and cannot reach backward's.
        live = [t.grad for t in tensors]
        for t in tensors:
            t.grad = None
        tr.depends = [None] * len(rows)
        for i, r in enumerate(rows):
            if tr.graph and probe_paths and r.registered and tr.requires[i] and not tr.has[i]:
                tr.depends[i] = causes.loss_depends(closure, r.tensor)
        if tr.graph and probe_paths:
            _explain(tr, closure)
        tr.read_graph = None
        for b, saved in buffers:  # the extra forward passes may have moved batch-norm statistics
            b.copy_(saved)
        for t, g in zip(tensors, live):
            t.grad = g
        _step_and_predict(tr, optimizer, step, rtol)
    finally:
        tr.scratch = tr.read_graph = None
        for t, g in zip(tensors, tr.grads_before):
            t.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return tr


def grads_may_be_rewritten(optimizer: torch.optim.Optimizer) -> bool:
    """Whether code the transition does not write runs between backward and the point where
    the step's gradient is read: a step pre- or post-hook (the optimizer's or a global one) or
    a ``step`` not torch's own (a subclass's, which may rescale .grad before the update)."""
    carried = sys.modules.get("gradrepro.watch.carried")  # not imported: no recorder holds hooks
    ours = carried.own_global_hooks() if carried else set()  # a recorder's carried check only reads .grad
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None),
             getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
             getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
    if any(h is None or len(set(h) - ours) > 0 for h in hooks):
        return True
    step = getattr(optimizer.step, "__func__", optimizer.step)  # an instance's own step counts too
    return not getattr(step, "__module__", "").startswith("torch.optim.")


def _fresh_loss(closure: Callable[[], torch.Tensor], tensors: list[torch.Tensor],
                model: nn.Module) -> tuple[torch.Tensor, bool]:
    """The closure's loss, and whether float16 autocast was on when the model ran."""
    seen: list[bool] = []
    handle = model.register_forward_pre_hook(lambda *_: seen.append(fp16_autocast()))
    try:
        with torch.enable_grad():
            loss = check_loss(closure())
    finally:
        handle.remove()
    if any(t.grad is not None for t in tensors):
        raise DiagnoseValueError(
            "the closure ran backward() itself (gradients appeared while it ran); pass a closure that "
            "only computes and returns the loss: diagnose runs zero_grad and backward")
    return loss, any(seen) or loss.dtype == torch.float16


def fp16_autocast() -> bool:
    """Is float16 autocast on for any device type (torch >= 2.4 asks by device type)?"""
    for device in ("cuda", "cpu", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
                return True
        except (TypeError, RuntimeError, AttributeError, ValueError):
            continue
    return False


def _backward(loss: torch.Tensor, retain: bool = False) -> None:
    try:
        loss.backward(retain_graph=retain)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0].split(" Hint:")[0]  # torch's own hint follows; ours replaces it
        if "inplace operation" in first or "in-place operation" in first:
            hint = ("an in-place operation (x += y, x.add_(...), x[i] = ..., nn.ReLU(inplace=True)) overwrote a "
                    "value backward needs; use the out-of-place form (x = x + y), and "
                    "torch.autograd.set_detect_anomaly(True) names the forward operation")
        elif "second time" in first:
            hint = ("the closure must compute a fresh loss on every call; a loss computed once outside it loses "
                    "its graph at its first backward")
        else:
            hint = "the loss's graph cannot be differentiated as it is"
        raise DiagnoseValueError(f"backward through the closure's loss failed: {first[:300]} ({hint})") from None


def _nonfinite(g: torch.Tensor | None, norm: float) -> float:
    """The NaN and inf entries of a gradient, counted only where there can be some: a tensor
    narrower than float64 whose float64 norm is finite has none (its entries' squares, at most
    (3.4e38)^2, cannot overflow a float64 sum), which saves a pass over most tensors."""
    if g is None or (math.isfinite(norm) and g.dtype not in (torch.float64, torch.complex128)):
        return 0.0
    return float((~torch.isfinite(g)).sum())


def _scratch(tr: Transition) -> float32_check.Scratch:
    """The transition's float32 buffers (``float32_check.Scratch``), made on first use."""
    if tr.scratch is None:
        sizes = [t.numel() for t in tr.tensors if float32_check.fits(t)]
        tr.scratch = float32_check.Scratch(max(sizes, default=0), tr.tensors[0].device if tr.tensors else "cpu")
    return tr.scratch


def _counts(g: torch.Tensor | None, tr: Transition) -> tuple[float, float]:
    """(non-zero entries, entries fp16 would flush to zero: |g| <= 2^-24, zeros included). A large
    float32 gradient's small entries are counted as the float32 sum of a 0/1 mask in a reused
    buffer (exact: every partial sum is an integer below 2^24), where an allocation and a
    boolean count cost more; where none is small, none is zero and no count of zeros is made."""
    if g is None:
        return 0.0, 0.0
    if float32_check.fits(g) and g.numel() < 2**24 and tr.scratch is not None and tr.scratch.holds(g):
        mask = torch.abs(g.reshape(-1), out=tr.scratch.take(g.numel())[0]).le_(FP16_FLUSH)
        small = float(mask.sum())
        return (float(g.numel()) if small == 0 else float(torch.count_nonzero(g))), small
    return float(torch.count_nonzero(g)), float((g.abs() <= FP16_FLUSH).sum())


def _classify(tr: Transition, tiny_factor: float) -> None:
    """Every gradient's statistics and state; registered tensors are judged among themselves,
    as the probe (which sees registered tensors only) judges them."""
    tensors = tr.tensors
    grads = [None if g is None else dense(g) for g in tr.grads]
    _scratch(tr)
    has = np.array([g is not None for g in grads])
    g_norm = np.array([_norm(g) for g in grads])
    p_norm = np.array([_norm(t) for t in tr.before])
    counts = np.array([_counts(g, tr) for g in grads]).reshape(len(grads), 2)
    nonzero, small = counts[:, 0], counts[:, 1]
    nonfinite = np.array([_nonfinite(g, norm) for g, norm in zip(grads, g_norm)])
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
    tr.state, tr.has, tr.g_norm, tr.p_norm = state, has, g_norm, p_norm
    tr.nonzero, tr.nonfinite, tr.numel, tr.g_to_p, tr.flush = nonzero, nonfinite, numel, g_to_p, flush
    tr.registered, tr.requires = registered, np.array([t.requires_grad for t in tensors])


def _explain(tr: Transition, closure: Callable[[], torch.Tensor]) -> None:
    """Known causes of the missing and zero gradients (``causes``); each costs extra forward
    passes, run only when such gradients exist. A closure that fails here costs the
    explanation, never the report."""
    tensors, n = tr.tensors, len(tr.rows)
    trainable = [i for i in range(n) if tr.registered[i] and tr.requires[i]]
    zero = [i for i in trainable if tr.state[i] == "zero"]
    movers = [i for i in trainable if id(tensors[i]) in tr.members and tr.p_norm[i] == 0
              and tr.state[i] in ("finite", "tiny")]
    try:
        tr.zero_causes = causes.zero_init_causes(closure, tensors, zero, movers)
        unexplained = [i for i in trainable if tr.state[i] == "none" or (i in zero and i not in tr.zero_causes)]
        tr.stochastic = causes.drawn_zeros(closure, tensors, [i for i in unexplained if tr.depends[i] is not True],
                                           same_as=tr.loss)
        if unexplained:
            tr.cuts = causes.cuts_by_tensor(causes.record_cuts(closure), tensors, unexplained)
        # Tried on zeros with a recorded cut too: a cut that removes a path leaves no gradient
        # (None), not a zero, so a tensor with a zero gradient has a differentiable path that a
        # cut on a side path (a comparison that builds a mask from the predictions) does not zero.
        tr.selected = causes.selected_out(closure, tensors, [i for i in zero if i not in tr.zero_causes
                                                             and i not in tr.stochastic])
        tr.gated = causes.gated_out(closure, tensors, [i for i in zero if i not in tr.zero_causes
                                                       and i not in tr.stochastic and i not in tr.selected])
        judged = tr.has & (tr.nonfinite == 0) & (tr.nonzero > 0) & (tr.p_norm > 0) & np.isfinite(tr.g_to_p)
        ordinary = {i for i in trainable if judged[i] and tr.state[i] == "finite"}
        tiny = [i for i in trainable if tr.state[i] == "tiny"]
        reruns: list = []
        tr.unattenuated = causes.ordinary_behind(_seen_by(closure, reruns), tensors, tiny, ordinary)
        open_tiny = [i for i in tiny if i not in tr.unattenuated and judged[i]]
        if open_tiny:
            reference = _spread(sorted(i for i in ordinary if tr.g_to_p[i] >= tr.median), REFERENCE_SAMPLE)
            # The backward's own graph where the rerun just made (under the test's seed) gave
            # the same loss, bit for bit: the test's forward and first backward are then those.
            same = tr.read_graph is not None and len(reruns) == 1 and causes.same_bits(reruns[0], tr.loss)
            tr.unaligned = causes.unaligned_gradients(closure, tensors, open_tiny + reference,
                                                      graph=tr.read_graph if same else None)
    except Exception as exc:  # noqa: BLE001 - the user's closure may do anything
        tr.notes.append(f"causes of missing/zero gradients not examined: the closure failed on a rerun ({exc})")


def _seen_by(closure: Callable[[], torch.Tensor], seen: list) -> Callable[[], torch.Tensor]:
    """The closure, its losses (detached) appended to ``seen``."""
    def run() -> torch.Tensor:
        out = closure()
        if isinstance(out, torch.Tensor):
            seen.append(out.detach())
        return out
    return run


# The reference of the random-direction test (``findings._unattenuated_reach``) is a median;
# this many reference tensors, spread over the model's order, estimate it, where asking the
# extra backward passes for every tensor's gradient allocated a copy of all of them.
REFERENCE_SAMPLE = 64


def _spread(indices: list[int], most: int) -> list[int]:
    """At most ``most`` of ``indices``, evenly spaced over them (all when there are fewer)."""
    if len(indices) <= most:
        return indices
    return [indices[round(k * (len(indices) - 1) / (most - 1))] for k in range(most)]


def _step_and_predict(tr: Transition, optimizer: torch.optim.Optimizer, step: bool, rtol: float) -> None:
    """One optimizer step; the gradient it used against the loss's; every parameter's change
    against the one its rule predicts from the gradient used, starting from the parameter as
    the step found it (after the forward pass: ``nn.Embedding(max_norm=...)`` renormalises rows)."""
    tensors, members, n = tr.tensors, tr.members, len(tr.rows)
    # The parameters as the step finds them: the copy taken before the call where the forward
    # passes left them equal (the usual case), so that no second copy of the model is held.
    tr.forward_changed = np.array([not same(t.detach(), b) for t, b in zip(tensors, tr.before)])
    tr.at_step = [t.detach().clone() if moved else b for t, b, moved in zip(tensors, tr.before, tr.forward_changed)]
    states_before = {i: snapshot_state(optimizer, tensors[i]) for i in range(n) if id(tensors[i]) in members}
    versions = [t._version for t in tensors]
    seen: dict[int, Any] = {}  # .grad as the step began (a post-hook may clear it afterwards)
    if step and tr.graph:
        handle = optimizer.register_step_pre_hook(
            lambda *_: seen.update({i: t.grad for i, t in enumerate(tensors)}))
        try:
            optimizer.step()
        except Exception as exc:  # noqa: BLE001 - any optimizer's failure becomes one clear line
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            hint = (" (an optimizer whose step needs a closure, such as LBFGS, is not supported; use step=False)"
                    if "closure" in text else "")
            raise DiagnoseValueError(f"optimizer.step() failed: {text[:300]}{hint}") from None
        finally:
            handle.remove()
        tr.stepped = True
    tr.used = [t.grad if t.grad is not None or not tr.stepped else seen.get(i) for i, t in enumerate(tensors)]
    rewritten = {i for i, v in enumerate(tr.grad_versions) if v is not None and tr.after_backward[i]._version != v}
    if rewritten:  # in place, by code no hook announced (the closure's reruns, a module hook)
        names = ", ".join(tr.rows[i].name for i in sorted(rewritten)[:4])
        tr.notes.append(f"the gradient of {len(rewritten)} tensor(s) ({names}) was rewritten in place between "
                        "backward and the step by code outside the optimizer's hooks; how it changed is not "
                        "known (no copy was kept)")
    tr.changes = [_change(tr, i, rtol) for i in range(n)]
    tr.rule = rule_name(optimizer)
    if tr.rule is None:
        tr.notes.append(f"update check skipped: no rule for {type(optimizer).__name__} (supported: {SUPPORTED})")
    changed = np.zeros(n, dtype=bool)
    update_norm, expected, rel_err = np.full(n, math.nan), np.full(n, math.nan), np.full(n, math.nan)
    matches = np.ones(n, dtype=bool)
    scratch = _scratch(tr)
    sgd = tr.rule == "sgd"
    for i, t in enumerate(tensors):
        after, start, used = t.detach(), tr.at_step[i], tr.used[i]
        # Where the step wrote the tensor in place (its version moved), torch.equal stops at the
        # first difference; elsewhere the tensor is most likely unchanged, and numpy's equality
        # reads the whole of it faster. Either way the answer is the comparison's, not the version's.
        changed[i] = not (torch.equal(after, start) if t._version != versions[i] else same(after, start))
        predicted_here = tr.stepped and id(t) in members and used is not None
        if not predicted_here:
            update_norm[i] = _moved(tr, after, start) if changed[i] else 0.0
            expected[i] = 0.0  # the optimizer skips a None gradient; a non-member is never touched
            matches[i] = not changed[i]
            rel_err[i] = 0.0 if not changed[i] else math.inf
            continue
        # A finite norm of the same gradient (the classification's) says every entry is finite.
        loss_grad = used is tr.grads[i] and i not in rewritten
        finite = (loss_grad and math.isfinite(tr.g_norm[i])) or all_finite(dense(used))
        if not finite or tr.rule is None:
            update_norm[i] = _moved(tr, after, start) if changed[i] else 0.0
            continue  # no update to predict from a NaN/Inf gradient (its own finding says so)
        # SGD, Adam and AdamW in float32 where the rounding bound decides the check
        # (float32_check); otherwise in float64.
        group, start_norm = members[id(t)][1], tr.p_norm[i] if start is tr.before[i] else None
        if sgd:
            verdict = float32_check.sgd_check(after, start, used, states_before[i], group, rtol, scratch,
                                              grad_norm=tr.g_norm[i] if loss_grad else None, start_norm=start_norm)
        elif tr.rule == "adam":
            decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
            verdict = float32_check.adam_check(after, start, used, states_before[i], group, decoupled, rtol, scratch,
                                               start_norm=start_norm)
        else:
            verdict = None
        if verdict is not None:
            update_norm[i], expected[i], matches[i] = verdict.update_norm, verdict.expected, verdict.matches
            rel_err[i] = (verdict.err / verdict.expected if verdict.expected > 0
                          else (0.0 if verdict.err == 0 else math.inf))
            continue
        # Each side widened once and reused below (each is a float64 copy of the tensor).
        after64, start64 = wide(after), wide(start)
        update_norm[i] = _norm(after64 - start64)
        predicted = predict(optimizer, members[id(t)][1], start64, used, states_before[i])
        if predicted is None:
            continue
        expected[i] = _norm(predicted - start64)
        err = _norm(after64 - predicted)
        floor = 2 * torch.finfo(t.dtype).eps * _norm(after64) if t.is_floating_point() or t.is_complex() else 0.0
        matches[i] = err <= rtol * expected[i] + floor
        rel_err[i] = err / expected[i] if expected[i] > 0 else (0.0 if err == 0 else math.inf)
    tr.changed, tr.update_norm, tr.expected, tr.rel_err, tr.matches = changed, update_norm, expected, rel_err, matches


def _moved(tr: Transition, after: torch.Tensor, start: torch.Tensor) -> float:
    """||after - start||: of a large float32 tensor in float32, in the scratch buffer; else in float64."""
    if (float32_check.fits(after) and tr.scratch is not None and tr.scratch.holds(after)
            and start.dtype == after.dtype and start.device == after.device):
        buf = tr.scratch.take(after.numel())[0]
        return _norm(torch.sub(after.reshape(-1), start.reshape(-1), out=buf))
    return _norm(wide(after) - wide(start))


def _change(tr: Transition, i: int, rtol: float) -> Change:
    """How the gradient the optimizer used differs from the loss's (``used_gradient.compare``);
    without a step, how .grad differed right after backward."""
    during = (has_tensor_hooks(tr.tensors[i])
              and compare(tr.grads[i], tr.after_backward[i], rtol).kind != "same")
    used = tr.used[i] if tr.stepped else tr.after_backward[i]
    return compare(tr.grads[i], used, rtol, during_backward=during)


def group_lr(member: tuple[int, dict] | None) -> float:
    """The learning rate of a tensor's param group (NaN outside the optimizer)."""
    if member is None:
        return math.nan
    lr = member[1].get("lr", math.nan)
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)
