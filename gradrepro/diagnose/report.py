"""The vocabulary of ``diagnose``'s report: findings (kind, name, detail, severity), the next
check to make for each kind, and the ``Report`` that prints them beside the table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import torch

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
    ".item()/.tolist()/torch.tensor(...) rebuilds, a non-differentiable operation (argmax, a comparison, an "
    "integer cast), or an output the loss never uses; "
    "check_derivative(closure, param) tells a severed path (finite differences non-zero) from an unused one (zero)",
    "zero_gradient": "look for dead units (ReLU never active), a saturated nonlinearity, a multiplication by "
    "zero, a step function (round, floor, sign: derivative zero), or underflow in reduced precision",
    "zero_init": "nothing to fix if the zero initialisation is intended; after one training step the tensors "
    "behind it receive gradient (diagnose again to see it)",
    "orphaned_leaf": "convert before wrapping, nn.Parameter(torch.ones(n, dtype=..., device=...)), or move the "
    "whole model with model.to(...) after building it; then build the optimizer",
    "grad_scaled": "nothing to fix if intended (gradient clipping, a loss scaler's unscale); the update was "
    "judged against the gradient the optimizer used",
    "grad_modified": "find what writes .grad between backward and the step: Tensor.register_hook or "
    "register_post_accumulate_grad_hook on the parameter, optimizer.register_step_pre_hook, clipping or "
    "scaling calls, a custom optimizer's step",
    "changed_in_forward": "nothing to fix if the module is meant to (nn.Embedding(max_norm=...) renormalises the "
    "rows it looks up); otherwise find the in-place write to the parameter in forward",
    "nonfinite_gradient": "find the first NaN/Inf: torch.autograd.set_detect_anomaly(True) for one step; "
    "check log/sqrt/division inputs and the loss scale",
    "tiny_gradient": "compare grad/param ratios layer by layer (the table): vanishing signal through depth, "
    "saturation, or a badly scaled initialisation",
    "fp16_underflow": "in fp16, use loss scaling (torch.amp.GradScaler) or bf16; harmless in fp32",
    "stale_gradient": "call optimizer.zero_grad() at every accumulation boundary (before each backward "
    "that starts a new step)",
    "leftover_gradient": "nothing to fix if your loop calls zero_grad before each backward",
    "redundant_parameter": "nothing to fix; the parameter can be dropped (bias=False on a layer in front of a "
    "batch normalisation, no bias on the key projection of an attention), which saves its memory and compute",
    "not_updated": "check the param group's lr (a warm-up at 0?), a step hook, or an update below the "
    "parameter dtype's resolution",
    "update_mismatch": "look for something else that writes the parameter or its .grad between backward "
    "and step: hooks, clipping, a second optimizer, a custom optimizer",
    "no_graph": "the loss was computed under torch.no_grad() or torch.inference_mode(), or from "
    "detached values: compute it with gradients enabled",
    "nonleaf_grad": "call t.retain_grad() before backward if you need an intermediate's gradient",
    "eval_mode": "nothing to fix for gradients; use model.train() when the training behaviour is intended",
    # kinds the recorder checks live (gradrepro.watch)
    "lr_zero": "print optimizer.param_groups[i]['lr'] over the steps: a scheduler whose total steps are too few "
    "(counted in optimizer steps, after accumulation), scheduler.step() called per batch on a per-epoch schedule, "
    "or lr=0 in the config",
    "frozen_norm_drift": "call .eval() on frozen BatchNorm layers after every model.train() (or freeze them with "
    "track_running_stats=False / torchvision's FrozenBatchNorm2d); requires_grad=False does not stop running "
    "statistics",
    "loss_scale_backoff": "find the first non-finite value with torch.autograd.set_detect_anomaly(True) for a few "
    "steps: a log/sqrt/division at 0 or an fp16 overflow in the forward pass; compute that part in float32",
}


@dataclass(frozen=True)
class Finding:
    kind: str
    name: str  # parameter name, or the attribute path for unregistered things
    detail: str
    severity: str = ERROR  # error | warning | info

    def __str__(self) -> str:
        return f"[{self.severity}] {self.kind} {self.name}: {self.detail}"


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


