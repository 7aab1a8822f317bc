"""The ``missing_grad/*`` experiments' objective: cross-entropy for training, and an evaluation
that runs ``gradrepro.diagnose`` on a copy of the network and its optimizer.

Each evaluation (before step 0, every ``eval.every`` steps, at the end) copies the network
with its optimizer (``diagnose`` takes a step: never on the network being trained), runs
``diagnose`` on a fixed held-out batch, checks the derivative of ``subject`` against central
finite differences (``check_derivative``), and returns numbers the signature checks:

- ``expected_found``: 1 when every ``expected`` entry (``kind:name-glob``, names written with
  dots: ``blocks.0``) is matched by a finding; ``unexpected_findings``: errors and warnings that
  match no entry; ``findings_flagged``: all errors and warnings; ``report_ok``.
- ``update_matches``: 1 when every parameter the optimizer stepped moved as its rule predicts;
  ``update_rel_err_max``; ``subject_changed``: 1 when ``subject`` moved in that step.
- ``derivative_rel_err``: autograd vs finite differences on ``subject`` (float64): ~0 on a
  connected path, 1 on a severed one (the loss depends on it, autograd says nothing), 0 on
  an unused one (neither sees a dependence).
"""

from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.diagnose import (
    DiagnoseError,
    Finding,
    Report,
    check_derivative,
    diagnose,
    normalize_name,
    parameter_rows,
)
from gradrepro.diagnose.findings import ERROR
from gradrepro.diagnose.placement import unmoved_tensors
from gradrepro.objectives.base import LossOutput


@dataclass
class MissingGradObjectiveConfig:
    name: str = "missing_grad"
    # Findings this case's defect produces, as "kind:name-glob" (the repaired control keeps the
    # same list and must not produce them).
    expected: list[str] = field(default_factory=list)
    subject: str = "encoder.weight"  # the parameter whose derivative is checked
    mode: str = "train"  # the mode the model is diagnosed in: train | eval
    n_fixed: int = 64  # fixed held-out examples the closure uses
    tiny_factor: float = 1e4
    stale_factor: float = 2.0


def expected_matches(report: Report, expected: list[str]) -> dict[str, float]:
    """How the report's findings compare with the expected ``kind:name-glob`` entries."""
    patterns = [e.split(":", 1) if ":" in e else [e, "*"] for e in expected]

    def hit(f, kind: str, glob: str) -> bool:
        return f.kind == kind and fnmatch.fnmatchcase(normalize_name(f.name), glob)

    found = all(any(hit(f, k, g) for f in report.findings) for k, g in patterns)
    flagged = report.flagged()
    unexpected = [f for f in flagged if not any(hit(f, k, g) for k, g in patterns)]
    return {
        "expected_found": float(found) if patterns else math.nan,
        "unexpected_findings": float(len(unexpected)),
        "findings_flagged": float(len(flagged)),
        "report_ok": float(report.ok),
    }


def copy_for_diagnosis(net: nn.Module, optimizer: torch.optim.Optimizer):
    """Deep copies of the network and its optimizer that share nothing with the originals."""
    # Intermediates a forward pass left in attributes are not leaves and cannot be deep-copied.
    memo = {id(v): None for m in net.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not v.is_leaf}
    net_copy, opt_copy = copy.deepcopy((net, optimizer), memo)
    # deepcopy does not copy a Parameter's .grad; a stale gradient is part of the state diagnosed,
    # and so is its version counter: backward adds into an existing .grad in place (bumping it),
    # which is how diagnose tells a gradient summed over passes from one written by a single pass.
    for row in parameter_rows(net, optimizer)[0]:
        if row.tensor.grad is not None and id(row.tensor) in memo:
            grad = row.tensor.grad.detach().clone()
            for _ in range(row.tensor.grad._version):
                grad.mul_(1)  # exact; one in-place operation per bump of the original's counter
            memo[id(row.tensor)].grad = grad
    # An LR scheduler wraps optimizer.step in a closure that holds a weak reference to the
    # original optimizer; a copied wrapper would step the original. Use the class's step.
    if getattr(opt_copy.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        del opt_copy.__dict__["step"]
    return net_copy, opt_copy


class MissingGrad:
    TRAIN_SCALARS = ()
    EVAL_SCALARS = ("expected_found", "unexpected_findings", "findings_flagged", "report_ok",
                    "update_matches", "update_rel_err_max", "subject_changed", "derivative_rel_err")

    def __init__(self, cfg: MissingGradObjectiveConfig) -> None:
        if cfg.mode not in ("train", "eval"):
            raise ValueError(f"objective.mode must be train or eval, not {cfg.mode!r}")
        self.cfg = cfg

    def wrap(self, model: nn.Module) -> nn.Module:
        if not callable(getattr(model, "on_optimizer", None)):  # held_out_metrics needs it: refused at build
            raise ValueError(f"objective=missing_grad needs model=missing_grad (a model with the runner's "
                             f"on_optimizer hook), not {type(model).__name__}")
        return model

    def __call__(self, net: nn.Module, batch: Batch) -> LossOutput:
        return LossOutput(F.cross_entropy(net(batch.x).float(), batch.y))

    def held_out_metrics(self, net: nn.Module, data: ImageData, knn_k: int = 20) -> dict[str, float]:
        optimizer = getattr(net, "optimizer", None)
        if optimizer is None:
            raise ValueError("the missing_grad objective needs a model with the runner's on_optimizer hook")
        model, opt = copy_for_diagnosis(net, optimizer)
        model.train(self.cfg.mode == "train")
        n = min(self.cfg.n_fixed, len(data.x_test))
        x, y = data.x_test[:n], data.y_test[:n]

        def closure() -> torch.Tensor:
            return F.cross_entropy(model(x).float(), y)

        unmoved = unmoved_tensors(model)
        try:
            report = diagnose(model, opt, closure, tiny_factor=self.cfg.tiny_factor,
                              stale_factor=self.cfg.stale_factor)
        except (RuntimeError, DiagnoseError):  # the transition's forward or backward cannot run
            if not unmoved:
                raise
            return self._registration_only(unmoved)
        out = expected_matches(report, list(self.cfg.expected))
        table = report.table
        checked = table[table["in_optimizer"] & table["grad_norm"].notna() & table["expected_change"].notna()]
        out["update_matches"] = float(bool(checked["update_ok"].all())) if len(checked) else math.nan
        errs = checked["update_rel_err"].replace([np.inf], np.nan)
        out["update_rel_err_max"] = float(errs.max()) if errs.notna().any() else math.nan
        names = {normalize_name(k): k for k in report.tensors}
        subject = names.get(normalize_name(self.cfg.subject))
        if subject is None:
            out["subject_changed"] = math.nan
            out["derivative_rel_err"] = math.nan
        else:
            out["subject_changed"] = float(table.loc[table["name"] == subject, "changed"].iloc[0])
            out["derivative_rel_err"] = check_derivative(closure, report.tensors[subject], model=model)
        return out

    def _registration_only(self, unmoved: dict) -> dict[str, float]:
        """On a device where the forward pass fails because unregistered tensors stayed behind
        (``.to`` moves registered ones only), diagnose cannot run a transition; what it reports
        from registration alone is the ``unregistered`` finding on each such tensor. Nothing
        trained, so the subject did not change; the gradient and update checks are not made."""
        findings = [Finding("unregistered", path, f"held in a plain attribute or container: .to() left it on "
                            f"{device}, so the forward pass fails with a device mismatch", ERROR)
                    for path, device in unmoved.items()]
        out = expected_matches(Report(findings, pd.DataFrame()), list(self.cfg.expected))
        out.update(update_matches=math.nan, update_rel_err_max=math.nan, derivative_rel_err=math.nan,
                   subject_changed=0.0)  # no step can run: nothing changes
        return out
