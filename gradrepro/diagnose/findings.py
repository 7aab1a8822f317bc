"""What ``diagnose`` finds (``report.Finding``, each with the next check to make) and its
table of every parameter tensor, built from the registration scan and the transition
(``transition.Transition``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradrepro.diagnose.report import ERROR, INFO, WARNING, Finding
from gradrepro.diagnose.severity import PERSIST_STEPS, ROUNDOFF
from gradrepro.diagnose.step_findings import step_findings
from gradrepro.diagnose.transition import Transition, _norm


def findings_of(tr: Transition, model: nn.Module, unregistered: list[tuple[str, Any]], step: bool,
                stale_factor: float, fp16_fraction: float, tiny_factor: float) -> list[Finding]:
    """Every finding, in the order the report lists them."""
    findings: list[Finding] = []
    if not tr.graph:
        how = "torch.inference_mode()" if tr.inference else "torch.no_grad(), or from detached values"
        findings.append(Finding("no_graph", "<loss>", f"the loss has no graph (computed under {how}); "
                                "no parameter can receive a gradient", ERROR))
    findings += _registration_findings(tr, unregistered)
    findings += _gradient_findings(tr, fp16_fraction, tiny_factor)
    findings += _zero_init_findings(tr)
    findings += _accumulation_findings(tr, stale_factor)
    findings += step_findings(tr)
    if not tr.stepped and not step:
        tr.notes.append("step=False: no optimizer step, so no update check")
    findings += _context_findings(tr, model)
    return findings


def _before_norms(tr: Transition) -> tuple[np.ndarray, np.ndarray]:
    """The norm of what each .grad held before the call, and where it held something non-zero."""
    if tr.before_grad_norm is None:  # asked for by three findings: one pass over the old gradients
        tr.before_grad_norm = np.array([_norm(g) for g in tr.grads_before])
    before_norm = tr.before_grad_norm
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
        if r.orphan_of:
            findings.append(_orphan_finding(r, id(tensors[i]) in members))
        if r.module == "<optimizer only>":
            same = [rows[j].name for j in range(len(rows)) if rows[j].registered and id(tensors[j]) not in members
                    and tensors[j].shape == tensors[i].shape]
            findings.append(Finding("stale_optimizer_param", r.name, (
                f"the optimizer holds a {tuple(tensors[i].shape)} tensor the model no longer owns"
                + (f" (the model's {', '.join(same)} has that shape and is not in the optimizer: "
                   "replaced after the optimizer was built?)" if same else "")), ERROR))
    return findings


def _orphan_finding(r, in_opt: bool) -> Finding:
    leaf, copy = r.tensor, r.copy
    what = "Parameter" if isinstance(leaf, nn.Parameter) else "leaf tensor"
    dtypes = lambda t: f"{str(t.dtype).replace('torch.', '')} on {t.device}"  # noqa: E731
    return Finding("orphaned_leaf", r.orphan_of, (
        f"holds a non-leaf copy ({type(copy.grad_fn).__name__}, {dtypes(copy)}) of a {tuple(leaf.shape)} {what} "
        f"({dtypes(leaf)}) that the model does not register"
        + (": the optimizer steps that leaf, but the forward pass uses the copy, made once when it was assigned, "
           "which no step changes" if in_opt else
           " and the optimizer does not hold: the copy was made once, when it was assigned, and never trains")
        + " (nn.Parameter(...) followed by .to(...), .double(), .cuda() at assignment)"), ERROR)


def _gradient_findings(tr: Transition, fp16_fraction: float, tiny_factor: float) -> list[Finding]:
    """Per registered tensor: frozen, outside the optimizer, and its gradient's state."""
    before_norm, had_before = _before_norms(tr)
    state, g_norm, has = tr.state, tr.g_norm, tr.has
    small = _small_by_design(tr, tiny_factor)
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
        redundant = _redundant(tr, i)
        if tr.graph and state[i] == "none":
            findings.append(_no_gradient(tr, i))
        elif state[i] == "zero" and redundant:
            findings.append(redundant)
        elif state[i] == "zero" and i in tr.stochastic:
            findings.append(Finding("zero_gradient", r.name, _DRAWN, INFO))
        elif state[i] == "zero" and i in tr.selected:
            findings.append(_selected_out(tr, i))
        elif state[i] == "zero" and i in tr.gated:
            findings.append(_gated_out(tr, i))
        elif state[i] == "zero" and i not in tr.zero_causes:
            cut = ("; its path goes through " + "; ".join(tr.cuts[i])) if i in tr.cuts else ""
            findings.append(Finding("zero_gradient", r.name, f"the gradient is exactly zero everywhere{cut}", WARNING))
        elif state[i] == "nonfinite":
            findings.append(Finding("nonfinite_gradient", r.name, f"{int(tr.nonfinite[i])} of {int(tr.numel[i])} "
                                    "gradient entries are NaN or Inf", ERROR))
        elif state[i] == "tiny":
            findings.append(redundant or _tiny(tr, i, small, tiny_factor))
        # A precision finding only where the gradient is in float16: a float16 tensor, or the loss
        # computed under float16 autocast (in float32 nothing flushes).
        in_fp16 = tr.fp16 or t.dtype == torch.float16
        if in_fp16 and state[i] in ("finite", "tiny") and tr.flush[i] > fp16_fraction:
            findings.append(Finding("fp16_underflow", r.name, f"{tr.flush[i]:.0%} of its non-zero gradient entries "
                                    "are below 2^-24 and would flush to zero in fp16", WARNING))
    return findings


_DRAWN = ("zero on this draw of the model's randomness (dropout, stochastic depth): with another random seed its "
          "gradient is not zero")


def _zero_this_batch(tr: Transition, i: int, why: str, persists: str) -> Finding:
    """A zero gradient this batch made (a selection that took nothing, gates all off):
    information, until it persists over logged steps."""
    return Finding("zero_gradient", tr.rows[i].name, f"the gradient is exactly zero on this batch: {why}"
                   f"gradrepro.record says when {persists} at {PERSIST_STEPS} logged steps in a row", INFO)


def _selected_out(tr: Transition, i: int) -> Finding:
    return _zero_this_batch(tr, i, (
        f"the loss reads this tensor's output through {tr.selected[i]}, which took none of the entries it feeds on "
        "this batch (a detection head's level no anchor matched, no positive location); with every entry selected "
        "its gradient is not zero (checked). A zero another batch fills: "), "it holds")


def _gated_out(tr: Transition, i: int) -> Finding:
    return _zero_this_batch(tr, i, (
        f"every path from the loss to it passes a {tr.gated[i]} that is off for every example here (or its input "
        "is such a gate's zero output); with the gates open its gradient is not zero (checked). Another batch can "
        "open them; units off on every batch are dead: "), "the zero holds")


def _no_gradient(tr: Transition, i: int) -> Finding:
    """Severed (the loss depends on it) is an error; unused (it does not) a warning, since a
    branch left out of the loss may be on purpose; one another random draw uses, information."""
    name = tr.rows[i].name
    if i in tr.cuts:
        return Finding("no_gradient", name, ".grad is None after backward: no graph path from the loss; the path is "
                       "cut by " + "; ".join(tr.cuts[i]), ERROR)
    if tr.depends[i] is True:
        return Finding("no_gradient", name, ".grad is None after backward: no graph path from the loss; the loss "
                       "depends on it (it changes when the parameter is nudged), so the path is severed: detach, "
                       "no_grad, or a .item()/torch.tensor rebuild", ERROR)
    if i in tr.stochastic:
        return Finding("no_gradient", name, ".grad is None after backward, but " + _DRAWN.replace("zero", "absent", 1),
                       INFO)
    if tr.depends[i] is False:
        return Finding("no_gradient", name, ".grad is None after backward: the loss does not use it (an unused "
                       "branch or output, such as an auxiliary head left out of the loss). Nothing to fix if on "
                       "purpose; DistributedDataParallel then needs find_unused_parameters=True", WARNING)
    return Finding("no_gradient", name, ".grad is None after backward: no graph path from the loss; run "
                   "check_derivative(closure, param) to tell a severed path from an unused one", ERROR)


def _redundant(tr: Transition, i: int) -> Finding | None:
    """A gradient zero by the architecture's algebra: the tensor's operation feeds a
    normalisation or softmax that cancels it (``graph.NORMALISERS``), and its gradient is round-off
    beside its peers' (below sqrt(eps32) of the median gradient norm of the other tensors that
    feed an operation of that kind in the model)."""
    if i not in tr.feeds or tr.state[i] not in ("zero", "tiny"):
        return None
    peers = [j for j, label in tr.feeds.items() if label == tr.feeds[i] and j != i and tr.state[j] == "finite"]
    if not peers:
        return None
    reference = float(np.median(tr.g_norm[peers]))
    if not tr.g_norm[i] <= ROUNDOFF * reference:
        return None
    return Finding("redundant_parameter", tr.rows[i].name, (
        f"its gradient is zero up to round-off ({tr.g_norm[i]:.3g}, against a median of {reference:.3g} for the other "
        f"tensors feeding such an operation): it feeds {tr.feeds[i]}, which cancels it by its algebra (a bias or "
        "shift in front of a train-mode normalisation, a key bias under a softmax). The parameter is redundant"), INFO)


def _small_by_design(tr: Transition, tiny_factor: float) -> list[int]:
    """Trainable tensors small by design (LayerScale's gain at 1e-5): non-zero, held by the
    optimizer, whose values are ``tiny_factor`` times below the model's median (root mean square):
    a gradient behind one is attenuated by it until the steps grow it."""
    rms = np.where(tr.numel > 0, tr.p_norm / np.sqrt(np.maximum(tr.numel, 1)), np.nan)
    movable = np.array([r.registered and tr.requires[k] and id(r.tensor) in tr.members and tr.p_norm[k] > 0
                        for k, r in enumerate(tr.rows)])
    if not movable.any():
        return []
    median = float(np.median(rms[movable]))
    return [int(k) for k in np.flatnonzero(movable & (rms < median / tiny_factor))]


def _tiny(tr: Transition, i: int, small: list[int], tiny_factor: float) -> Finding:
    """A warning where the gradient reaching the tensor's operation is attenuated (a vanishing
    gradient); information where a gain small by design is in the model, where a tensor behind
    the operation has an ordinary gradient, or where the gradient it would get from the same
    incoming norms in random directions is of the reference tensors' size (the smallness is the
    tensor's own size or role)."""
    detail = f"grad/param ratio {tr.g_to_p[i]:.3g} is {tr.median / tr.g_to_p[i]:.3g} times below the model's median " \
             f"{tr.median:.3g}"
    if i in tr.unattenuated and not small:
        j = tr.unattenuated[i]
        return Finding("tiny_gradient", tr.rows[i].name, detail + (
            f"; the gradient reaching the operation it enters is not attenuated: {tr.rows[j].name}, which the loss "
            f"reaches only through that operation, has an ordinary ratio ({tr.g_to_p[j]:.3g}), which a vanishing "
            "gradient would have made tiny too. Small by its role there (a gain that a normalisation after it "
            "mostly cancels, a small input), not a vanishing gradient; gradrepro.record says when it holds at "
            f"{PERSIST_STEPS} logged steps in a row"),
            INFO)
    reach = _unattenuated_reach(tr, i, tiny_factor)
    if reach is not None and not small:
        return Finding("tiny_gradient", tr.rows[i].name, detail + (
            f"; the gradient that reaches it is not attenuated: with the gradient reaching its operation kept in "
            f"norm and given a random direction, its gradient is {reach:.3g} times below the median of the tensors "
            f"at or above the median ratio, not {tiny_factor:g} times (a vanishing gradient or a small input to its "
            "operation keeps it that far below in every direction). Its ratio is small by its own size or role (a "
            "gain at 1 beside small weights, a scale that a normalisation after it cancels), not by attenuation; "
            f"gradrepro.record says when it holds at {PERSIST_STEPS} logged steps in a row"),
            INFO)
    if small:
        names = ", ".join(tr.rows[k].name for k in small[:4]) + (" ..." if len(small) > 4 else "")
        return Finding("tiny_gradient", tr.rows[i].name, detail + (
            f"; the model has {len(small)} trainable tensor(s) small by design ({names}: a gain such as LayerScale "
            "at 1e-5), which attenuate what is behind them until the steps grow them. One transition cannot tell "
            f"that from a vanishing gradient: gradrepro.record says when it holds at {PERSIST_STEPS} logged steps in "
            "a row"), INFO)
    return Finding("tiny_gradient", tr.rows[i].name, detail, WARNING)


def _unattenuated_reach(tr: Transition, i: int, tiny_factor: float) -> float | None:
    """How far the tensor's gradient with random incoming directions (``causes.unaligned_gradients``:
    the gradient reaching each operation it enters keeps its norm, not its direction) falls below
    the median of the same quantity over the reference tensors, where it is not ``tiny_factor``
    below it (the gradient reaching it and its operation's input are of ordinary size); None
    otherwise. The reference tensors are those the tiny rule measures against: a ratio at or
    above the model's median. Not all tensors that are not tiny: where a vanishing gradient
    attenuates much of the model, those include the attenuated ones (the ratio's median moves
    with them), and the reference would move toward the tensor judged."""
    ordinary = [tr.unaligned[j] for j in tr.unaligned if tr.state[j] == "finite" and tr.g_to_p[j] >= tr.median]
    if i not in tr.unaligned or not ordinary:
        return None
    reference = float(np.median(ordinary))
    below = reference / tr.unaligned[i] if tr.unaligned[i] > 0 else math.inf
    return below if below <= tiny_factor else None


def _zero_init_findings(tr: Transition) -> list[Finding]:
    """One finding per zero-initialised weight that explains zero gradients behind it (``causes``)."""
    behind: dict[tuple[int, ...], list[str]] = {}
    for i, cause in tr.zero_causes.items():
        behind.setdefault(cause, []).append(tr.rows[i].name)
    findings = []
    for cause, names in behind.items():
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        it, its = ("it", "its") if len(cause) == 1 else ("them", "their")
        findings.append(Finding("zero_init", ", ".join(tr.rows[j].name for j in cause), (
            f"{'initialised' if len(cause) == 1 else f'{len(cause)} tensors initialised'} to zero, so the "
            f"{len(names)} tensor(s) behind {it} ({shown}) get an exactly zero gradient until {it} move; {its} own "
            f"gradient is not zero, so one step moves {it} and the tensors behind receive gradient from the next "
            f"(checked: with {it} set to small random values, they do). Expected for a zero-initialised head, a "
            "low-rank adapter's second matrix or a zero residual gain"), INFO))
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
    # Autograd adds a second backward's gradient into .grad in place, which bumps the tensor's
    # version counter. One backward alone can leave a version above 0 too (a tensor used by
    # several operations whose gradients the engine sums in place, an index backward that
    # writes into its buffer): diagnose's own backward, made into an empty .grad, gives that
    # tensor's count. A .grad at no more than that count was written by one backward alone
    # (what a loop that sets gradients to None before each backward leaves), not a sum of them.
    added = [int(i) for i in np.flatnonzero(present) if _added_in_place(tr, int(i))]
    single = not added
    finite = bool(np.isfinite(before_norm[present]).all())
    if finite and (single or (both.any() and ratio <= stale_factor)):
        how = ("each written by one backward pass alone (none was added to in place)" if single else
               f"{ratio:.2g} times a fresh one over the model")
        return [Finding("leftover_gradient", "<model>", (
            f"{int(present.sum())} tensor(s) held a gradient from an earlier backward, {how}: what a loop that "
            "zeroes before each backward leaves after its step; diagnose used a fresh gradient"), INFO)]
    findings = []
    for i in added:
        own = before_norm[i] / g_norm[i] if tr.has[i] and g_norm[i] > 0 else math.inf
        findings.append(Finding("stale_gradient", tr.rows[i].name, (
            f"a gradient was already in .grad before the diagnostic backward, added to in place since it was made "
            f"({own:.3g} times the fresh one; {ratio:.3g} times over the model): backward passes are being summed, "
            "no zero_grad at the accumulation boundary? One snapshot cannot tell that from in-place clipping and "
            "a large earlier gradient; gradrepro.record's live check tells exactly"), WARNING))
    return findings


def _added_in_place(tr: Transition, i: int) -> bool:
    """Was the ``.grad`` found before the call changed in place after the backward that made
    it: its version counter above the one diagnose's own backward leaves on that tensor?"""
    one_backward = tr.fresh_versions[i] if tr.fresh_versions and tr.fresh_versions[i] is not None else 0
    return tr.grads_before[i]._version > one_backward


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
        "zero_because": [", ".join(tr.rows[j].name for j in tr.zero_causes[i]) if i in tr.zero_causes else ""
                         for i in range(len(rows))],
        "grad_used": [c.kind for c in tr.changes],
        "changed_in_forward": tr.forward_changed,
        "changed": tr.changed,
        "update_norm": tr.update_norm,
        "expected_change": tr.expected,
        "update_rel_err": tr.rel_err,
        "update_ok": np.where(np.isnan(tr.expected), np.nan, tr.matches.astype(float)),
    })
