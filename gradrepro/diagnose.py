"""Why does a parameter not learn? One controlled transition of a user's own model.

    from gradrepro.diagnose import diagnose
    report = diagnose(model, optimizer, closure)   # closure() computes and returns the scalar loss
    print(report)                                   # what is wrong, where, and the next check

``diagnose`` follows the procedure of ``shared/seeds/diagnose-missing-gradients.txt``: keep
registration, graph participation, gradient accumulation and optimizer membership apart, and
verify one transition against an independent expectation.

1. registration (``named_parameters``, plus a scan of plain attributes, lists, tuples and dicts
   for modules and requires-grad tensors that are not registered) and optimizer membership,
   both by identity;
2. gradients already present (a missing ``zero_grad`` boundary), then the parameters (and
   buffers) are snapshotted and every ``.grad`` cleared;
3. a fresh loss from ``closure()``, ``backward()``, every gradient classified with the probe's
   own rule (``gradrepro.probe.grad_states``: none / zero / tiny / finite / nonfinite);
4. one ``optimizer.step()`` (unless ``step=False``), and every parameter's actual change
   compared with the change the optimizer's rule predicts from its gradient and its state
   before the step (``gradrepro.update_rule``; SGD, Adam, AdamW).

What it changes: with ``step=True`` the parameters and the optimizer's state advance by exactly
that one step (the step the report describes; it is not undone, so parameters and optimizer
state stay consistent). With ``step=False`` neither changes. In both cases every ``.grad`` is
put back as it was before the call (``None`` stays ``None``; a stale gradient stays, so the
report does not hide it), registered buffers (batch-norm statistics) are restored, and the
train/eval mode is untouched. The closure may be called a few more times, without gradients
and with a fixed random seed, to test whether the loss depends on a parameter that received no
gradient (``probe_paths``); those calls are undone too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from gradrepro.errors import UserError
from gradrepro.probe import FP16_FLUSH, grad_states
from gradrepro.update_rule import SUPPORTED, predict, rule_name, snapshot_state

ERROR, WARNING, INFO = "error", "warning", "info"

# The next check to make for each kind of finding (printed under it).
NEXT_CHECK: dict[str, str] = {
    "unregistered": "hold layers in nn.ModuleList/nn.ModuleDict and trainable tensors in nn.Parameter "
    "(or register_buffer if they must not train), then rebuild the optimizer",
    "not_in_optimizer": "build the optimizer after the model's final structure; compare "
    "{id(p) for g in opt.param_groups for p in g['params']} with {id(p) for p in model.parameters()}",
    "stale_optimizer_param": "a module was replaced after the optimizer was built: rebuild the optimizer "
    "(or add the new parameters with optimizer.add_param_group)",
    "frozen": "intended? requires_grad=False is how freezing works; if not, find the requires_grad_(False) call",
    "frozen_in_optimizer": "harmless while frozen (a None gradient is skipped); leave it out of the optimizer "
    "if it stays frozen",
    "no_gradient": "trace the path from this parameter to the loss: look for .detach(), torch.no_grad(), "
    ".item()/.tolist()/torch.tensor(...) rebuilds, or an output the loss never uses; "
    "check_derivative(closure, param) tells a severed path (finite differences non-zero) from an unused one (zero)",
    "zero_gradient": "look for dead units (ReLU never active), a saturated nonlinearity, a multiplication by "
    "zero, or underflow in reduced precision",
    "nonfinite_gradient": "find the first NaN/Inf: torch.autograd.set_detect_anomaly(True) for one step; "
    "check log/sqrt/division inputs and the loss scale",
    "tiny_gradient": "compare grad/param ratios layer by layer (the table): vanishing signal through depth, "
    "saturation, or a badly scaled initialisation",
    "fp16_underflow": "in fp16, use loss scaling (torch.amp.GradScaler) or bf16; harmless in fp32",
    "stale_gradient": "call optimizer.zero_grad() at every accumulation boundary (before each backward "
    "that starts a new step)",
    "leftover_gradient": "nothing to fix if your loop calls zero_grad before each backward",
    "not_updated": "check the param group's lr (a warm-up at 0?), a step hook, or an update below the "
    "parameter dtype's resolution",
    "update_mismatch": "look for something else that writes the parameter or its .grad between backward "
    "and step: hooks, clipping, a second optimizer, a custom optimizer",
    "no_graph": "the loss was computed under torch.no_grad() or torch.inference_mode(), or from "
    "detached values: compute it with gradients enabled",
    "nonleaf_grad": "call t.retain_grad() before backward if you need an intermediate's gradient",
    "eval_mode": "nothing to fix for gradients; use model.train() when the training behaviour is intended",
}


class DiagnoseError(UserError):
    """Bad input to ``diagnose`` or ``check_derivative``: one clear line."""


class DiagnoseTypeError(DiagnoseError, TypeError):
    pass


class DiagnoseValueError(DiagnoseError, ValueError):
    pass


@dataclass(frozen=True)
class Finding:
    kind: str
    name: str  # parameter name, or the attribute path for unregistered things
    detail: str
    severity: str = ERROR  # error | warning | info


@dataclass
class Report:
    findings: list[Finding]
    table: pd.DataFrame  # one row per parameter tensor (registered, unregistered, optimizer-only)
    loss: float = math.nan
    stepped: bool = False
    optimizer: str = ""
    notes: list[str] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # table name -> tensor

    @property
    def ok(self) -> bool:
        """False when any finding is an error (warnings and information do not count)."""
        return not any(f.severity == ERROR for f in self.findings)

    def flagged(self) -> list[Finding]:
        """Errors and warnings: what a healthy model should not have."""
        return [f for f in self.findings if f.severity != INFO]

    def kinds(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for f in self.findings:
            out.setdefault(f.kind, []).append(f.name)
        return out

    def __str__(self) -> str:
        counts = {s: sum(f.severity == s for f in self.findings) for s in (ERROR, WARNING, INFO)}
        step = "one step taken" if self.stepped else "no step taken"
        head = (f"diagnose: {'OK' if self.ok else 'PROBLEMS FOUND'} ({counts[ERROR]} errors, "
                f"{counts[WARNING]} warnings, {counts[INFO]} notes); loss {self.loss:.6g}; "
                f"{self.optimizer}, {step}")
        cols = ["name", "registered", "requires_grad", "in_optimizer", "grad_state", "grad_norm",
                "grad_to_param", "changed", "expected_change", "update_rel_err"]
        table = self.table[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}")
        lines = [head, "", table]
        order = {ERROR: 0, WARNING: 1, INFO: 2}
        groups: dict[tuple[str, str], list[Finding]] = {}
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            groups.setdefault((f.severity, f.kind), []).append(f)
        for (severity, kind), found in groups.items():
            lines += ["", f"[{severity}] {kind}: {', '.join(f.name for f in found)}"]
            lines += [f"  - {f.name}: {f.detail}" for f in found]
            lines.append(f"  next check: {NEXT_CHECK.get(kind, '')}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --- registration -------------------------------------------------------------------------

_MODULE_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping attributes
_SCAN_DEPTH = 3  # containers inside containers, this deep
_SCAN_ITEMS = 256  # items looked at per container


def _scan(model: nn.Module, known: set) -> tuple[list[tuple[str, Any]], list[tuple[str, torch.Tensor]]]:
    """Plain attributes (and the lists, tuples, dicts in them) that hold modules with
    parameters ``known`` lacks or requires-grad tensors: (unregistered, non-leaf) by path."""
    unregistered: list[tuple[str, Any]] = []
    nonleaf: list[tuple[str, torch.Tensor]] = []
    visited: set = set()

    def visit(path: str, value: Any, depth: int) -> None:
        if isinstance(value, (torch.Tensor, nn.Module, list, tuple, dict)):
            if id(value) in visited:
                return
            visited.add(id(value))
        if isinstance(value, torch.Tensor):
            if id(value) not in known and value.requires_grad:
                (unregistered if value.is_leaf else nonleaf).append((path, value))
        elif isinstance(value, nn.Module):
            if any(id(p) not in known for p in value.parameters()):
                unregistered.append((path, value))
        elif isinstance(value, (list, tuple)) and depth < _SCAN_DEPTH:
            for i, item in enumerate(itertools.islice(value, _SCAN_ITEMS)):
                visit(f"{path}[{i}]", item, depth + 1)
        elif isinstance(value, dict) and depth < _SCAN_DEPTH:
            for key, item in itertools.islice(value.items(), _SCAN_ITEMS):
                visit(f"{path}[{key!r}]", item, depth + 1)

    for mod_name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_ATTRS:
                visit(f"{mod_name}.{key}" if mod_name else key, value, 0)
    return unregistered, nonleaf


def normalize_name(name: str) -> str:
    """``blocks[0].weight`` and ``blocks['a']`` as ``blocks.0.weight`` and ``blocks.a``."""
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", name)


@dataclass
class _Row:
    name: str
    module: str
    tensor: torch.Tensor
    registered: bool
    aliases: str = ""


def parameter_rows(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[_Row], list[tuple[str, Any]],
                                                                          list[tuple[str, torch.Tensor]]]:
    """Every parameter tensor: registered (probe order, tied weights once), unregistered ones
    found in plain attributes, and tensors only the optimizer holds; with the scan's findings."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    rows, seen = [], set()
    for mod_name, module in model.named_modules():  # the probe's order: module by module
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied weight is one tensor: one row, its other names as aliases
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            rows.append(_Row(full, mod_name or "<root>", p, True, ", ".join(n for n in names[id(p)] if n != full)))
    known = seen | {id(b) for b in model.buffers()}
    unregistered, nonleaf = _scan(model, known)
    for path, thing in unregistered:
        if isinstance(thing, nn.Module):
            for p_name, p in thing.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    rows.append(_Row(f"{path}.{p_name}", path, p, False))
        elif id(thing) not in seen:
            seen.add(id(thing))
            rows.append(_Row(path, path.rpartition(".")[0] or "<root>", thing, False))
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                rows.append(_Row(f"param_groups.{gi}.params.{pi}", "<optimizer only>", p, False))
    return rows, unregistered, nonleaf


# --- input checks -------------------------------------------------------------------------

def _check_inputs(model: Any, optimizer: Any, closure: Any) -> None:
    if not isinstance(model, nn.Module):
        raise DiagnoseTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DiagnoseTypeError(
            f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
            + (" (pass the optimizer, not its param_groups or a scheduler)" if optimizer is not None else ""))
    if not callable(closure):
        raise DiagnoseTypeError(f"closure must be callable (closure() returns the loss), not {type(closure).__name__}")
    if not any(True for _ in model.parameters()):
        raise DiagnoseValueError(
            f"{type(model).__name__} has no registered parameters: nothing to diagnose "
            "(if its layers live in a plain list or tensor attribute, that is the bug: "
            "use nn.ModuleList / nn.Parameter)")


def _check_loss(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        raise DiagnoseTypeError(
            f"closure returned a {type(out).__name__} of {len(out)} items; return the scalar loss alone")
    if isinstance(out, (float, int, np.generic)):
        raise DiagnoseTypeError(
            f"closure returned a Python number ({out!r}): .item() or float() cut the graph; return the loss tensor")
    if not isinstance(out, torch.Tensor):
        raise DiagnoseTypeError(f"closure must return the loss tensor, not {type(out).__name__}")
    if out.numel() != 1:
        raise DiagnoseValueError(
            f"closure returned a tensor of shape {tuple(out.shape)}; reduce it to the scalar loss (.mean() or .sum())")
    if not out.is_floating_point():
        raise DiagnoseTypeError(f"closure returned a {out.dtype} tensor; a loss must be floating point")
    return out


# --- the transition -----------------------------------------------------------------------

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


def diagnose(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    closure: Callable[[], torch.Tensor],
    step: bool = True,
    tiny_factor: float = 1e4,
    stale_factor: float = 2.0,
    fp16_fraction: float = 0.5,
    rtol: float = 1e-3,
    probe_paths: bool = True,
) -> Report:
    """One controlled transition of ``model`` (see the module docstring for what it changes).

    ``closure()`` computes and returns the scalar loss (no backward, no zero_grad: diagnose does
    both). ``tiny_factor``: a gradient is tiny when its grad/param ratio is this many times below
    the model's median. ``stale_factor``: a gradient present before the call is stale when it is
    more than this many times the fresh one (backward passes summed); one about the size of a
    fresh one is what a loop that zeroes at the start of each step leaves behind. ``fp16_fraction``:
    share of non-zero entries below fp16's flush threshold that raises ``fp16_underflow``.
    ``rtol``: tolerance of the update check, relative to the predicted change.
    """
    _check_inputs(model, optimizer, closure)
    rows, unregistered, nonleaf = parameter_rows(model, optimizer)
    members: dict[int, tuple[int, dict]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            members[id(p)] = (gi, group)
    findings: list[Finding] = []
    notes: list[str] = []
    tensors = [r.tensor for r in rows]
    grads_before = [t.grad for t in tensors]
    before = [t.detach().clone() for t in tensors]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    n = len(rows)
    stepped, loss_value, graph = False, math.nan, True
    try:
        for t in tensors:
            t.grad = None
        with torch.enable_grad():
            loss = _check_loss(closure())
        loss_value = float(loss.detach().double())
        if any(t.grad is not None for t in tensors):
            raise DiagnoseValueError(
                "the closure ran backward() itself (gradients appeared while it ran); pass a closure that "
                "only computes and returns the loss: diagnose runs zero_grad and backward")
        if not loss.requires_grad:
            graph = False
            how = "torch.inference_mode()" if loss.is_inference() else "torch.no_grad(), or from detached values"
            findings.append(Finding("no_graph", "<loss>", f"the loss has no graph (computed under {how}); "
                                    "no parameter can receive a gradient", ERROR))
        else:
            try:
                loss.backward()
            except RuntimeError as exc:
                first = str(exc).splitlines()[0]
                raise DiagnoseValueError(
                    f"backward through the closure's loss failed: {first} (the closure must compute a fresh "
                    "loss on every call; a loss computed once outside it loses its graph at its first backward)"
                ) from None
        _, nonleaf_after = _scan(model, {id(t) for t in tensors} | {id(b) for b, _ in buffers})
        for path, t in nonleaf_after:
            if all(path != p for p, _ in nonleaf):
                nonleaf.append((path, t))

        # -- classify every gradient with the probe's rule ----------------------------------
        grads = [t.grad for t in tensors]
        has = np.array([g is not None for g in grads])
        g_norm = np.array([_norm(g) for g in grads])
        p_norm = np.array([_norm(t) for t in before])
        nonzero = np.array([float(torch.count_nonzero(g)) if g is not None else 0.0 for g in grads])
        nonfinite = np.array([float((~torch.isfinite(g)).sum()) if g is not None else 0.0 for g in grads])
        small = np.array([float((g.abs() <= FP16_FLUSH).sum()) if g is not None else 0.0 for g in grads])
        numel = np.array([float(t.numel()) for t in tensors])
        with np.errstate(divide="ignore", invalid="ignore"):
            g_to_p = g_norm / np.where(p_norm > 0, p_norm, np.nan)
            flush = np.where(nonzero > 0, (small - (numel - nonzero)) / nonzero, np.nan)
        registered = np.array([r.registered for r in rows])
        state = grad_states(has, nonfinite, nonzero, g_to_p, p_norm, tiny_factor)
        if registered.any():  # the probe sees registered tensors only: judge them among themselves
            state[registered] = grad_states(has[registered], nonfinite[registered], nonzero[registered],
                                            g_to_p[registered], p_norm[registered], tiny_factor)
        judged = registered & has & (nonfinite == 0) & (nonzero > 0) & (p_norm > 0) & np.isfinite(g_to_p)
        median = float(np.median(g_to_p[judged])) if judged.any() else math.nan

        depends: list[bool | None] = [None] * n
        requires = np.array([t.requires_grad for t in tensors])
        for i, r in enumerate(rows):
            if graph and probe_paths and r.registered and requires[i] and not has[i]:
                depends[i] = _loss_depends(closure, r.tensor)
        for b, saved in buffers:  # the extra forward passes may have moved batch-norm statistics
            b.copy_(saved)

        # -- one optimizer step, and the change its rule predicts ---------------------------
        states_before = {i: snapshot_state(optimizer, tensors[i]) for i in range(n)
                         if id(tensors[i]) in members and grads[i] is not None}
        if step and graph:
            try:
                optimizer.step()
            except Exception as exc:  # noqa: BLE001 - any optimizer's failure becomes one clear line
                raise DiagnoseValueError(
                    f"optimizer.step() failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__} "
                    "(an optimizer whose step needs a closure, such as LBFGS, is not supported; use step=False)"
                ) from None
            stepped = True
        rule = rule_name(optimizer)
        if rule is None:
            notes.append(f"update check skipped: no rule for {type(optimizer).__name__} (supported: {SUPPORTED})")
        changed = np.zeros(n, dtype=bool)
        update_norm = np.full(n, math.nan)
        expected = np.full(n, math.nan)
        rel_err = np.full(n, math.nan)
        matches = np.ones(n, dtype=bool)
        for i, t in enumerate(tensors):
            after = t.detach()
            changed[i] = not torch.equal(after, before[i])
            update_norm[i] = _norm(after.double() - before[i].double())
            if not stepped or id(t) not in members or grads[i] is None:
                expected[i] = 0.0  # the optimizer skips a None gradient; a non-member is never touched
                matches[i] = not changed[i]
                rel_err[i] = 0.0 if not changed[i] else math.inf
                continue
            predicted = predict(optimizer, members[id(t)][1], before[i], grads[i], states_before[i])
            if predicted is None:
                continue
            expected[i] = _norm(predicted - before[i].double())
            err = _norm(after.double() - predicted)
            floor = 2 * torch.finfo(t.dtype).eps * _norm(after) if t.is_floating_point() else 0.0
            matches[i] = err <= rtol * expected[i] + floor
            rel_err[i] = err / expected[i] if expected[i] > 0 else (0.0 if err == 0 else math.inf)
    finally:
        for t, g in zip(tensors, grads_before):
            t.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)

    # -- findings --------------------------------------------------------------------------
    for path, thing in unregistered:
        if isinstance(thing, nn.Module):
            count = sum(1 for r in rows if not r.registered and r.module == path)
            what = f"a {type(thing).__name__} with {count} parameter tensor(s) held in a plain attribute or container"
        else:
            what = f"a requires-grad tensor {tuple(thing.shape)} held in a plain attribute or container"
        inside = [i for i, r in enumerate(rows) if not r.registered and (r.name == path or r.module == path)]
        in_opt = any(id(tensors[i]) in members for i in inside)
        stale = any(grads_before[i] is not None for i in inside)
        findings.append(Finding("unregistered", path, (
            f"{what}: invisible to named_parameters(), state_dict() and .to(); "
            f"{'the optimizer holds it anyway' if in_opt else 'not in the optimizer, so it never trains'}"
            + ("; its .grad held gradients from earlier backward passes (nothing zeroes it)" if stale else "")),
            ERROR))
    for i, r in enumerate(rows):
        if r.module == "<optimizer only>":
            same = [rows[j].name for j in range(n) if rows[j].registered and id(tensors[j]) not in members
                    and tensors[j].shape == tensors[i].shape]
            findings.append(Finding("stale_optimizer_param", r.name, (
                f"the optimizer holds a {tuple(tensors[i].shape)} tensor the model no longer owns"
                + (f" (the model's {', '.join(same)} has that shape and is not in the optimizer: "
                   "replaced after the optimizer was built?)" if same else "")), ERROR))
    before_norm = np.array([_norm(g) for g in grads_before])
    had_before = np.array([g is not None for g in grads_before]) & (np.nan_to_num(before_norm, nan=1.0) > 0)
    in_opt_all = np.array([id(t) in members for t in tensors])
    for i, r in enumerate(rows):
        if not r.registered:
            continue
        t = tensors[i]
        in_opt = id(t) in members
        if not t.requires_grad:
            kind = "frozen_in_optimizer" if in_opt else "frozen"
            findings.append(Finding(kind, r.name, "requires_grad=False: it does not train (intentional freezing is "
                                    "legitimate)" + ("; the optimizer still holds it" if in_opt else ""), INFO))
            continue
        if not in_opt:
            held = (f"; nothing zeroes its .grad, which held {before_norm[i]:.3g} before the call "
                    f"({before_norm[i] / g_norm[i]:.3g} times a fresh gradient)"
                    if had_before[i] and has[i] and g_norm[i] > 0 else "")
            findings.append(Finding("not_in_optimizer", r.name, "trainable and registered, but no param group holds "
                                    "this tensor (compared by identity)" + held, ERROR))
        if graph and state[i] == "none":
            why = {True: "the loss depends on it (it changes when the parameter is nudged), so the path is "
                         "severed: detach, no_grad, or a .item()/torch.tensor rebuild",
                   False: "the loss does not depend on it at all: an unused branch or output",
                   None: "run check_derivative(closure, param) to tell a severed path from an unused one"}[depends[i]]
            findings.append(Finding("no_gradient", r.name, f".grad is None after backward: no graph path from the "
                                    f"loss; {why}", ERROR))
        elif state[i] == "zero":
            findings.append(Finding("zero_gradient", r.name, "the gradient is exactly zero everywhere", ERROR))
        elif state[i] == "nonfinite":
            findings.append(Finding("nonfinite_gradient", r.name,
                                    f"{int(nonfinite[i])} of {int(numel[i])} gradient entries are NaN or Inf", ERROR))
        elif state[i] == "tiny":
            findings.append(Finding("tiny_gradient", r.name, f"grad/param ratio {g_to_p[i]:.3g} is "
                                    f"{median / g_to_p[i]:.3g} times below the model's median {median:.3g}", WARNING))
        if state[i] in ("finite", "tiny") and flush[i] > fp16_fraction:
            findings.append(Finding("fp16_underflow", r.name, f"{flush[i]:.0%} of its non-zero gradient entries are "
                                    f"below 2^-24 and would flush to zero in fp16", WARNING))
    # Stale gradients are judged on the whole model: a gradient left by one earlier backward (a
    # loop that zeroes at the start of each step) is about as large as a fresh one in total,
    # although single tensors vary with the batch; summed passes make it several times larger.
    # Tensors outside the optimizer are not zeroed by optimizer.zero_grad(): their accumulation is
    # explained by their own finding (not_in_optimizer, unregistered), not by a missing boundary.
    present = registered & in_opt_all & had_before
    if present.any():
        both = present & has
        fresh_total = float(np.sqrt(np.sum(g_norm[both] ** 2))) if both.any() else 0.0
        total = float(np.sqrt(np.sum(before_norm[both] ** 2))) if both.any() else math.inf
        ratio = total / fresh_total if fresh_total > 0 else math.inf
        if not np.isfinite(before_norm[present]).all() or ratio > stale_factor or not both.any():
            for i in np.flatnonzero(present):
                own = before_norm[i] / g_norm[i] if has[i] and g_norm[i] > 0 else math.inf
                findings.append(Finding("stale_gradient", rows[i].name, (
                    f"a gradient was already in .grad before the diagnostic backward ({own:.3g} times the fresh "
                    f"one; {ratio:.3g} times over the model): backward passes are being summed, no zero_grad "
                    "at the accumulation boundary"), ERROR))
        else:
            findings.append(Finding("leftover_gradient", "<model>", (
                f"{int(present.sum())} tensor(s) held a gradient from an earlier backward, {ratio:.2g} times a "
                "fresh one over the model: what a loop that zeroes before each backward leaves after its step; "
                "diagnose used a fresh gradient"), INFO))
    if stepped:
        for i, r in enumerate(rows):
            if not requires[i] and not changed[i]:
                continue
            lr = _scalar_lr(members.get(id(tensors[i])))
            if (id(tensors[i]) in members and state[i] in ("finite", "tiny") and not changed[i]):
                rounds = expected[i] > 0 and expected[i] < 0.5 * torch.finfo(tensors[i].dtype).eps * p_norm[i]
                detail = ("finite non-zero gradient and held by the optimizer, yet unchanged by the step"
                          + (f"; its group's lr is {lr:g}" if lr == 0 else "")
                          + (f"; the predicted change {expected[i]:.3g} is below the resolution of "
                             f"{tensors[i].dtype}" if rounds else ""))
                findings.append(Finding("not_updated", r.name, detail, WARNING if lr == 0 else ERROR))
            elif changed[i] and not matches[i]:
                findings.append(Finding("update_mismatch", r.name, (
                    f"moved by {update_norm[i]:.4g}; the {rule or 'optimizer'} rule predicts {expected[i]:.4g} "
                    f"(relative error {rel_err[i]:.3g})"), ERROR))
    elif not step:
        notes.append("step=False: no optimizer step, so no update check")
    for path, t in nonleaf:
        findings.append(Finding("nonleaf_grad", path, (
            f"an intermediate result (non-leaf, made by {type(t.grad_fn).__name__}): its .grad stays None unless "
            f"{path}.retain_grad() is called before backward; that is not a disconnection (the parameters "
            "that produced it are in the table)"), INFO))
    in_eval = [name or "<model>" for name, m in model.named_modules() if not m.training]
    if in_eval:
        findings.append(Finding("eval_mode", "<model>" if not model.training else ", ".join(in_eval), (
            f"{len(in_eval)} module(s) in eval() mode: dropout and batch norm behave as at inference; "
            "eval() changes behaviour, not autograd, so gradients still flow (see the table)"), INFO))

    table = pd.DataFrame({
        "name": [r.name for r in rows],
        "module": [r.module for r in rows],
        "shape": [tuple(t.shape) for t in tensors],
        "dtype": [str(t.dtype).replace("torch.", "") for t in tensors],
        "registered": registered,
        "aliases": [r.aliases for r in rows],
        "requires_grad": requires,
        "in_optimizer": [id(t) in members for t in tensors],
        "param_group": [members[id(t)][0] if id(t) in members else -1 for t in tensors],
        "grad_before_norm": before_norm,
        "grad_state": state,
        "grad_norm": g_norm,
        "param_norm": p_norm,
        "grad_to_param": g_to_p,
        "frac_zero": np.where(has, (numel - nonzero) / np.maximum(numel, 1), np.nan),
        "frac_nonfinite": np.where(has, nonfinite / np.maximum(numel, 1), np.nan),
        "frac_fp16_underflow": flush,
        "loss_depends": [np.nan if d is None else float(d) for d in depends],
        "changed": changed,
        "update_norm": update_norm,
        "expected_change": expected,
        "update_rel_err": rel_err,
        "update_ok": np.where(np.isnan(expected), np.nan, matches.astype(float)),
    })
    return Report(findings, table, loss_value, stepped, type(optimizer).__name__, notes,
                  {r.name: r.tensor for r in rows})


def _scalar_lr(member: tuple[int, dict] | None) -> float:
    if member is None:
        return math.nan
    lr = member[1].get("lr", math.nan)
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)


# --- an independent derivative ------------------------------------------------------------

_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_INPLACE = re.compile(r"^(__i\w+__|__setitem__|\w*[^_]_)$")


class _Float64(TorchFunctionMode):
    """Runs every torch operation in float64: floating tensor arguments below float64 are
    promoted (differentiably, so gradients still reach float32 parameters). The tensor an
    in-place operation writes to is left alone, so in-place writes keep their meaning."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # attribute reads (.shape, .grad, ...) on the original tensor
            return func(*args, **kwargs)

        def up(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype in _NARROW:
                return x.to(torch.float64)
            if isinstance(x, torch.dtype) and x in _NARROW:  # .to(torch.float32), dtype=torch.float32
                return torch.float64
            return x

        if name in ("float", "half", "bfloat16") and args:  # a cast down would undo the promotion
            return up(args[0])
        if _INPLACE.match(name) and args:
            return func(args[0], *tree_map(up, tuple(args[1:])), **tree_map(up, kwargs))
        return func(*tree_map(up, tuple(args)), **tree_map(up, kwargs))


def _entries(index: Any, shape: torch.Size, grad: torch.Tensor | None, n_entries: int, seed: int) -> list[int]:
    numel = int(np.prod(shape)) if len(shape) else 1
    if index is None:
        if numel <= n_entries:
            return list(range(numel))
        picks = [int(grad.abs().argmax())] if grad is not None else []
        rng = np.random.default_rng(seed)
        for j in rng.permutation(numel):
            if len(picks) >= n_entries:
                break
            if int(j) not in picks:
                picks.append(int(j))
        return picks
    items = index if isinstance(index, list) else [index]
    flat = []
    for item in items:
        try:
            j = int(np.ravel_multi_index(item, tuple(shape))) if isinstance(item, tuple) else int(item)
        except (TypeError, ValueError) as exc:
            raise DiagnoseValueError(
                f"index {item!r} does not address an entry of a {tuple(shape)} tensor: {exc}"
            ) from None
        if not 0 <= j < numel:
            raise DiagnoseValueError(f"index {item!r} is outside a tensor of {numel} entries")
        flat.append(j)
    return flat


def check_derivative(
    closure: Callable[[], torch.Tensor],
    param: torch.Tensor,
    index: None | int | tuple[int, ...] | Sequence[Any] = None,
    eps: float = 1e-4,
    n_entries: int = 5,
    model: nn.Module | None = None,
    seed: int = 0,
    float64: bool = True,
) -> float:
    """Relative error between autograd's derivative of ``closure()`` with respect to chosen
    entries of ``param`` and central finite differences, both computed in float64.

    ``index``: a flat index, a tuple index, or a list of either; by default the entry with the
    largest gradient and random others (``n_entries`` in all, ``seed``). Each entry is moved by
    +-``eps * max(1, |p|)`` (the step actually stored in the parameter's dtype is the one used).
    With ``float64`` every operation of the closure runs in float64 (a TorchFunctionMode promotes
    float32/16 arguments), so a float32 model needs no change. Every closure call starts from the
    same random seed (dropout masks agree). A parameter with ``requires_grad=False`` is enabled
    for the check and disabled again; a gradient that does not exist counts as zero, so a
    severed path shows a relative error of 1 and an unused parameter 0. ``model``: its buffers
    (batch-norm statistics) are restored afterwards. Returns ||auto - fd|| / max(||auto||, ||fd||)
    over the entries (0 when both are zero).
    """
    if not callable(closure):
        raise DiagnoseTypeError(f"closure must be callable, not {type(closure).__name__}")
    if not isinstance(param, torch.Tensor) or not param.is_floating_point():
        raise DiagnoseTypeError(f"param must be a floating-point tensor, not {type(param).__name__}")
    if not param.is_leaf:
        raise DiagnoseValueError("param must be a leaf tensor (a parameter), not an intermediate result")
    if eps <= 0:
        raise DiagnoseValueError(f"eps={eps} must be > 0")
    buffers = [(b, b.detach().clone()) for b in model.buffers()] if model is not None else []
    mode = _Float64 if float64 else None

    def loss(with_grad: bool) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.set_grad_enabled(with_grad), (mode() if mode else contextlib.nullcontext()):
            return _check_loss(closure())

    requires = param.requires_grad
    saved = param.detach().clone()
    try:
        with torch.random.fork_rng():
            param.requires_grad_(True)
            out = loss(True)
            grad = torch.autograd.grad(out, [param], allow_unused=True)[0] if out.requires_grad else None
            param.requires_grad_(requires)
            picks = _entries(index, param.shape, grad, n_entries, seed)
            auto = np.array([float(grad.reshape(-1)[j]) if grad is not None else 0.0 for j in picks])
            fd = np.zeros(len(picks))
            flat = param.data.view(-1) if param.is_contiguous() else None
            if flat is None:
                raise DiagnoseValueError("param must be contiguous for finite differences")
            for k, j in enumerate(picks):
                p0 = float(saved.reshape(-1)[j])
                h = eps * max(1.0, abs(p0))
                with torch.no_grad():
                    flat[j] = p0 + h
                    hi = float(flat[j])
                    plus = float(loss(False).detach().double())
                    flat[j] = p0 - h
                    lo = float(flat[j])
                    minus = float(loss(False).detach().double())
                    flat[j] = saved.reshape(-1)[j]
                fd[k] = (plus - minus) / (hi - lo)
    finally:
        with torch.no_grad():
            param.copy_(saved)
            for b, s in buffers:
                b.copy_(s)
        param.requires_grad_(requires)
    scale = max(np.linalg.norm(auto), np.linalg.norm(fd))
    return float(np.linalg.norm(auto - fd) / scale) if scale > 0 else 0.0


__all__ = [
    "NEXT_CHECK",
    "DiagnoseError",
    "DiagnoseTypeError",
    "DiagnoseValueError",
    "Finding",
    "Report",
    "check_derivative",
    "diagnose",
    "normalize_name",
]
