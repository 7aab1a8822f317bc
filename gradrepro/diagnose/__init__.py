"""Why does a parameter not learn? One controlled transition of a user's own model.

    from gradrepro.diagnose import diagnose
    report = diagnose(model, optimizer, closure)   # closure() computes and returns the scalar loss
    print(report)                                   # what is wrong, where, and the next check

``diagnose`` follows the procedure of the PyTorch editorial guide "Diagnose missing gradients
and unchanged parameters": keep registration, graph participation, gradient accumulation and
optimizer membership apart, and verify one transition against an independent expectation.
Each step is a module of this package: ``inputs``, ``registration``, ``transition``
(snapshot, backward, classify, step and predict with ``update_rule``), ``causes``,
``used_gradient``, ``findings`` and ``step_findings`` (what is reported, in the vocabulary of
``report``), and ``derivative`` (``check_derivative``, an independent derivative by finite
differences).

0. lazy modules (``nn.LazyLinear``, ...) not yet initialised get one dry run of the closure
   (eval mode, no gradients), as PyTorch asks before training;
1. registration (``named_parameters``, plus a scan of plain attributes, lists, tuples and dicts
   for modules and requires-grad tensors that are not registered, and for non-leaf copies
   whose graph leads to a leaf nothing holds) and optimizer membership, both by identity; an
   optimizer that holds none of the model's tensors (built over another model) is refused in
   one line;
2. gradients already present (a missing ``zero_grad`` boundary), then the parameters (and
   buffers) are snapshotted and every ``.grad`` cleared;
3. a fresh loss from ``closure()``, ``backward()``, every gradient of the loss classified with
   the probe's own rule (``gradrepro.probe.states``: none / zero / tiny / finite / nonfinite);
   zero and missing gradients are traced to known causes (``causes``: a zero-initialised
   weight downstream, a non-differentiable operation, an unused output, a selection by index
   that took none of a tensor's entries on this batch), and tiny ones told from a vanishing
   gradient by the tensors behind their operation and by the gradient the same incoming norms
   give in random directions;
4. one ``optimizer.step()`` (unless ``step=False``); the gradient the optimizer used is
   compared with the loss's (``used_gradient``: scaled, zeroed, sign-flipped, ...), and every
   parameter's actual change with the change the optimizer's rule predicts from the gradient
   it used, its value as the step found it and its state before the step (``update_rule``;
   SGD, Adam, AdamW, SparseAdam).

What it changes: with ``step=True`` the parameters and the optimizer's state advance by exactly
that one step (the step the report describes; it is not undone, so parameters and optimizer
state stay consistent). With ``step=False`` neither changes. In both cases every ``.grad`` is
put back as it was before the call (``None`` stays ``None``; a stale gradient stays, so the
report does not hide it), registered buffers (batch-norm statistics) are restored, and the
train/eval mode is untouched. The closure may be called a few more times with a fixed random
seed (``probe_paths``): to test whether the loss depends on a parameter that received no
gradient, to find what cuts a missing or zero gradient's path, to test a zero-initialised
weight or a selection as its cause, and to read the graph behind a tiny gradient; those calls
are undone too. Lazy modules stay initialised (by one dry run, as their first training step
would), and a forward pass that rewrites a parameter in place (``nn.Embedding(max_norm=...)``)
does so as it would in training.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from gradrepro.diagnose.derivative import check_derivative
from gradrepro.diagnose.findings import findings_of, report_table
from gradrepro.diagnose.inputs import (
    DiagnoseError,
    DiagnoseTypeError,
    DiagnoseValueError,
    check_inputs,
    check_optimizer_of,
    check_options,
    materialize_lazy,
)
from gradrepro.diagnose.registration import normalize_name, parameter_rows
from gradrepro.diagnose.report import NEXT_CHECK, Finding, Report
from gradrepro.diagnose.transition import run_transition


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
    the model's median. ``stale_factor``: a gradient present before the call that was added to
    in place (its version counter above the one a single backward leaves on that tensor) is stale
    when it is more than this many times the fresh one (backward passes summed); one written by a
    single backward, or about the size of a fresh one, is what a loop that zeroes at the start of
    each step leaves behind.
    ``fp16_fraction``: share of non-zero entries below fp16's flush threshold that raises
    ``fp16_underflow``, where the gradient is in fp16 (an fp16 tensor or fp16 autocast).
    Severities follow ``gradrepro.diagnose.severity``.
    ``rtol``: tolerance of the update check, relative to the predicted change.
    """
    check_inputs(model, optimizer, closure)
    check_options(step, tiny_factor, stale_factor, fp16_fraction, rtol, probe_paths)
    lazy = materialize_lazy(model, closure)
    rows, unregistered, nonleaf = parameter_rows(model, optimizer)
    check_optimizer_of(model, optimizer, {id(r.tensor) for r in rows if r.module != "<optimizer only>"})
    tr = run_transition(model, optimizer, closure, rows, nonleaf, step, tiny_factor, rtol, probe_paths)
    if lazy:
        tr.notes.append(f"lazy module(s) {', '.join(lazy)} were initialised by one dry run of the closure "
                        "(eval mode, no gradients) before the transition")
    findings = findings_of(tr, model, unregistered, step, stale_factor, fp16_fraction, tiny_factor)
    return Report(findings, report_table(tr), tr.loss_value, tr.stepped, type(optimizer).__name__, tr.notes,
                  {r.name: r.tensor for r in rows})


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
    "parameter_rows",
]
