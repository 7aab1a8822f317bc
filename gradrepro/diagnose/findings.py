"""What ``diagnose`` reports: findings (kind, name, detail, severity), each with the next
check to make, and a table of every parameter tensor, built from the registration scan and
the transition (``transition.Transition``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradrepro.diagnose.transition import Transition, _norm, group_lr

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


def findings_of(tr: Transition, model: nn.Module, unregistered: list[tuple[str, Any]], step: bool,
                stale_factor: float, fp16_fraction: float) -> list[Finding]:
    """Every finding, in the order the report lists them."""
    findings: list[Finding] = []
    if not tr.graph:
        how = "torch.inference_mode()" if tr.inference else "torch.no_grad(), or from detached values"
        findings.append(Finding("no_graph", "<loss>", f"the loss has no graph (computed under {how}); "
                                "no parameter can receive a gradient", ERROR))
    findings += _registration_findings(tr, unregistered)
    findings += _gradient_findings(tr, fp16_fraction)
    findings += _accumulation_findings(tr, stale_factor)
    findings += _update_findings(tr)
    if not tr.stepped and not step:
        tr.notes.append("step=False: no optimizer step, so no update check")
    findings += _context_findings(tr, model)
    return findings


def _before_norms(tr: Transition) -> tuple[np.ndarray, np.ndarray]:
    """The norm of what each .grad held before the call, and where it held something non-zero."""
    before_norm = np.array([_norm(g) for g in tr.grads_before])
    had_before = np.array([g is not None for g in tr.grads_before]) & (np.nan_to_num(before_norm, nan=1.0) > 0)
    return before_norm, had_before


def _registration_findings(tr: Transition, unregistered: list[tuple[str, Any]]) -> list[Finding]:
    rows, tensors, members = tr.rows, tr.tensors, tr.members
    findings = []
    for path, thing in unregistered:
        if isinstance(thing, nn.Module):
            count = sum(1 for r in rows if not r.registered and r.module == path)
            what = f"a {type(thing).__name__} with {count} parameter tensor(s) held in a plain attribute or container"
        else:
            what = f"a requires-grad tensor {tuple(thing.shape)} held in a plain attribute or container"
        inside = [i for i, r in enumerate(rows) if not r.registered and (r.name == path or r.module == path)]
        in_opt = any(id(tensors[i]) in members for i in inside)
        stale = any(tr.grads_before[i] is not None for i in inside)
        findings.append(Finding("unregistered", path, (
            f"{what}: invisible to named_parameters(), state_dict() and .to(); "
            f"{'the optimizer holds it anyway' if in_opt else 'not in the optimizer, so it never trains'}"
            + ("; its .grad held gradients from earlier backward passes (nothing zeroes it)" if stale else "")),
            ERROR))
    for i, r in enumerate(rows):
        if r.module == "<optimizer only>":
            same = [rows[j].name for j in range(len(rows)) if rows[j].registered and id(tensors[j]) not in members
                    and tensors[j].shape == tensors[i].shape]
            findings.append(Finding("stale_optimizer_param", r.name, (
                f"the optimizer holds a {tuple(tensors[i].shape)} tensor the model no longer owns"
                + (f" (the model's {', '.join(same)} has that shape and is not in the optimizer: "
                   "replaced after the optimizer was built?)" if same else "")), ERROR))
    return findings


def _gradient_findings(tr: Transition, fp16_fraction: float) -> list[Finding]:
    """Per registered tensor: frozen, outside the optimizer, and its gradient's state."""
    before_norm, had_before = _before_norms(tr)
    state, g_norm, has = tr.state, tr.g_norm, tr.has
    findings = []
    for i, r in enumerate(tr.rows):
        if not r.registered:
            continue
        t = r.tensor
        in_opt = id(t) in tr.members
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
        if tr.graph and state[i] == "none":
            why = {True: "the loss depends on it (it changes when the parameter is nudged), so the path is "
                         "severed: detach, no_grad, or a .item()/torch.tensor rebuild",
                   False: "the loss does not depend on it at all: an unused branch or output",
                   None: "run check_derivative(closure, param) to tell a severed path from an unused one",
                   }[tr.depends[i]]
            findings.append(Finding("no_gradient", r.name, f".grad is None after backward: no graph path from the "
                                    f"loss; {why}", ERROR))
        elif state[i] == "zero":
            findings.append(Finding("zero_gradient", r.name, "the gradient is exactly zero everywhere", ERROR))
        elif state[i] == "nonfinite":
            findings.append(Finding("nonfinite_gradient", r.name, f"{int(tr.nonfinite[i])} of {int(tr.numel[i])} "
                                    "gradient entries are NaN or Inf", ERROR))
        elif state[i] == "tiny":
            findings.append(Finding("tiny_gradient", r.name, f"grad/param ratio {tr.g_to_p[i]:.3g} is "
                                    f"{tr.median / tr.g_to_p[i]:.3g} times below the model's median {tr.median:.3g}",
                                    WARNING))
        if state[i] in ("finite", "tiny") and tr.flush[i] > fp16_fraction:
            findings.append(Finding("fp16_underflow", r.name, f"{tr.flush[i]:.0%} of its non-zero gradient entries "
                                    "are below 2^-24 and would flush to zero in fp16", WARNING))
    return findings


def _accumulation_findings(tr: Transition, stale_factor: float) -> list[Finding]:
    """Stale gradients are judged on the whole model: a gradient left by one earlier backward (a
    loop that zeroes at the start of each step) is about as large as a fresh one in total,
    although single tensors vary with the batch; summed passes make it several times larger.
    Tensors outside the optimizer are not zeroed by optimizer.zero_grad(): their accumulation is
    explained by their own finding (not_in_optimizer, unregistered), not by a missing boundary."""
    before_norm, had_before = _before_norms(tr)
    in_opt_all = np.array([id(t) in tr.members for t in tr.tensors])
    present = tr.registered & in_opt_all & had_before
    if not present.any():
        return []
    both = present & tr.has
    g_norm = tr.g_norm
    fresh_total = float(np.sqrt(np.sum(g_norm[both] ** 2))) if both.any() else 0.0
    total = float(np.sqrt(np.sum(before_norm[both] ** 2))) if both.any() else math.inf
    ratio = total / fresh_total if fresh_total > 0 else math.inf
    if not np.isfinite(before_norm[present]).all() or ratio > stale_factor or not both.any():
        findings = []
        for i in np.flatnonzero(present):
            own = before_norm[i] / g_norm[i] if tr.has[i] and g_norm[i] > 0 else math.inf
            findings.append(Finding("stale_gradient", tr.rows[i].name, (
                f"a gradient was already in .grad before the diagnostic backward ({own:.3g} times the fresh "
                f"one; {ratio:.3g} times over the model): backward passes are being summed, no zero_grad "
                "at the accumulation boundary"), ERROR))
        return findings
    return [Finding("leftover_gradient", "<model>", (
        f"{int(present.sum())} tensor(s) held a gradient from an earlier backward, {ratio:.2g} times a "
        "fresh one over the model: what a loop that zeroes before each backward leaves after its step; "
        "diagnose used a fresh gradient"), INFO)]


def _update_findings(tr: Transition) -> list[Finding]:
    """After a step: a parameter the optimizer should have moved and did not, or moved otherwise."""
    if not tr.stepped:
        return []
    findings = []
    for i, r in enumerate(tr.rows):
        t = r.tensor
        if not tr.requires[i] and not tr.changed[i]:
            continue
        lr = group_lr(tr.members.get(id(t)))
        if id(t) in tr.members and tr.state[i] in ("finite", "tiny") and not tr.changed[i]:
            expected = tr.expected[i]
            rounds = expected > 0 and expected < 0.5 * torch.finfo(t.dtype).eps * tr.p_norm[i]
            detail = ("finite non-zero gradient and held by the optimizer, yet unchanged by the step"
                      + (f"; its group's lr is {lr:g}" if lr == 0 else "")
                      + (f"; the predicted change {expected:.3g} is below the resolution of "
                         f"{t.dtype}" if rounds else ""))
            findings.append(Finding("not_updated", r.name, detail, WARNING if lr == 0 else ERROR))
        elif tr.changed[i] and not tr.matches[i]:
            findings.append(Finding("update_mismatch", r.name, (
                f"moved by {tr.update_norm[i]:.4g}; the {tr.rule or 'optimizer'} rule predicts "
                f"{tr.expected[i]:.4g} (relative error {tr.rel_err[i]:.3g})"), ERROR))
    return findings


def _context_findings(tr: Transition, model: nn.Module) -> list[Finding]:
    """Information that is not a disconnection: non-leaf intermediates and eval-mode modules."""
    findings = []
    for path, t in tr.nonleaf:
        findings.append(Finding("nonleaf_grad", path, (
            f"an intermediate result (non-leaf, made by {type(t.grad_fn).__name__}): its .grad stays None unless "
            f"{path}.retain_grad() is called before backward; that is not a disconnection (the parameters "
            "that produced it are in the table)"), INFO))
    in_eval = [name or "<model>" for name, m in model.named_modules() if not m.training]
    if in_eval:
        findings.append(Finding("eval_mode", "<model>" if not model.training else ", ".join(in_eval), (
            f"{len(in_eval)} module(s) in eval() mode: dropout and batch norm behave as at inference; "
            "eval() changes behaviour, not autograd, so gradients still flow (see the table)"), INFO))
    return findings


def report_table(tr: Transition) -> pd.DataFrame:
    """One row per parameter tensor (registered, unregistered, optimizer-only)."""
    rows, tensors, members = tr.rows, tr.tensors, tr.members
    before_norm, _ = _before_norms(tr)
    numel, nonzero, has = tr.numel, tr.nonzero, tr.has
    return pd.DataFrame({
        "name": [r.name for r in rows],
        "module": [r.module for r in rows],
        "shape": [tuple(t.shape) for t in tensors],
        "dtype": [str(t.dtype).replace("torch.", "") for t in tensors],
        "registered": tr.registered,
        "aliases": [r.aliases for r in rows],
        "requires_grad": tr.requires,
        "in_optimizer": [id(t) in members for t in tensors],
        "param_group": [members[id(t)][0] if id(t) in members else -1 for t in tensors],
        "grad_before_norm": before_norm,
        "grad_state": tr.state,
        "grad_norm": tr.g_norm,
        "param_norm": tr.p_norm,
        "grad_to_param": tr.g_to_p,
        "frac_zero": np.where(has, (numel - nonzero) / np.maximum(numel, 1), np.nan),
        "frac_nonfinite": np.where(has, tr.nonfinite / np.maximum(numel, 1), np.nan),
        "frac_fp16_underflow": tr.flush,
        "loss_depends": [np.nan if d is None else float(d) for d in tr.depends],
        "changed": tr.changed,
        "update_norm": tr.update_norm,
        "expected_change": tr.expected,
        "update_rel_err": tr.rel_err,
        "update_ok": np.where(np.isnan(tr.expected), np.nan, tr.matches.astype(float)),
    })
