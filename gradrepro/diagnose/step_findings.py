"""What ``diagnose`` finds around the optimizer step: the gradient the optimizer used against
the loss's (``used_gradient``), a parameter the forward pass itself changed, and every
parameter's actual change against the one its update rule predicts."""

from __future__ import annotations

import numpy as np

from gradrepro.diagnose.graph import wide
from gradrepro.diagnose.report import ERROR, INFO, WARNING, Finding
from gradrepro.diagnose.severity import below_resolution
from gradrepro.diagnose.transition import Transition, _norm, group_lr
from gradrepro.diagnose.used_gradient import describe, severity_of


def step_findings(tr: Transition) -> list[Finding]:
    return _used_gradient_findings(tr) + _forward_findings(tr) + _update_findings(tr)


def _used_gradient_findings(tr: Transition) -> list[Finding]:
    """Per tensor, how the gradient the optimizer used differs from the loss's. When every
    tensor with a gradient was scaled by one factor (clip_grad_norm_, an unscale), one note."""
    with_grad = [i for i in range(len(tr.rows)) if tr.grads[i] is not None]
    scaled = [i for i in with_grad if tr.changes[i].kind == "scaled"]
    factors = [tr.changes[i].factor for i in scaled]
    if scaled and len(scaled) == len(with_grad) and max(factors) - min(factors) <= tr.rtol * max(factors):
        return [Finding("grad_scaled", "<model>", f"every gradient ({len(scaled)} tensors) was scaled by "
                        f"{factors[0]:.4g} between backward and the step (clip_grad_norm_, or an unscale?); the "
                        "update is judged against the scaled gradient", INFO)]
    findings = []
    for i in with_grad + [i for i in range(len(tr.rows)) if tr.changes[i].kind == "added"]:
        severity = severity_of(tr.changes[i])
        if severity is not None:
            kind = "grad_scaled" if tr.changes[i].kind == "scaled" else "grad_modified"
            findings.append(Finding(kind, tr.rows[i].name, describe(tr.changes[i]), severity))
    return findings


def _forward_findings(tr: Transition) -> list[Finding]:
    findings = []
    for i in np.flatnonzero(tr.forward_changed):
        moved = _norm(wide(tr.at_step[i]) - wide(tr.before[i]))
        findings.append(Finding("changed_in_forward", tr.rows[i].name, (
            f"the forward pass changed it in place (by {moved:.3g}; nn.Embedding(max_norm=...) renormalises the "
            "rows it looks up): the step is judged from its value after the forward pass"), INFO))
    return findings


def _not_updated_severity(tr: Transition, lr: float, rounds: bool) -> str:
    """Below the dtype's resolution: rounding (information). At lr 0 in one param group: a
    warm-up or a group held on purpose (information; a warning when every group is at 0, for
    then nothing trains). Otherwise the update rule is contradicted: an error."""
    if rounds:
        return INFO
    if lr == 0:
        lrs = {group_lr(m) for m in tr.members.values()}
        return WARNING if lrs == {0.0} else INFO
    return ERROR


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
        change = tr.changes[i].kind
        if (id(t) in tr.members and tr.state[i] in ("finite", "tiny") and not tr.changed[i]
                and change in ("same", "scaled", "removed")):
            expected = tr.expected[i]
            # The rule's own prediction, made in the tensor's dtype, moves nothing (it rounds away),
            # or moves it by under half an ulp of its norm: no change is what the dtype allows.
            rounds = change != "removed" and lr != 0 and (
                expected == 0 or below_resolution(float(expected), float(tr.p_norm[i]), t.dtype))
            detail = ("finite non-zero gradient and held by the optimizer, yet unchanged by the step"
                      + (f"; its group's lr is {lr:g}" if lr == 0 else "")
                      + ("; its .grad was removed (set to None) between backward and the step, so the optimizer "
                         "skipped it" if change == "removed" else "")
                      + (f"; the predicted change {expected:.3g} is below half an ulp of the tensor in "
                         f"{str(t.dtype).replace('torch.', '')}: rounding, not a bug" if rounds else ""))
            findings.append(Finding("not_updated", r.name, detail, _not_updated_severity(tr, lr, rounds)))
        elif tr.changed[i] and not tr.matches[i]:
            findings.append(Finding("update_mismatch", r.name, (
                f"moved by {tr.update_norm[i]:.4g}; the {tr.rule or 'optimizer'} rule predicts "
                f"{tr.expected[i]:.4g} from the gradient it used (relative error {tr.rel_err[i]:.3g})"), ERROR))
    return findings
