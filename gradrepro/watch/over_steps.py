"""``diagnose``-style findings from a run's records (``modules.parquet``), per parameter over
its logged steps: no gradient, exactly zero, tiny, non-finite, not updated. The states are
the probe's (``gradrepro.probe.states``); the severity follows ``severity``: a NaN or Inf is an
error at once; no, zero or tiny gradients are information until they hold at every one of
``PERSIST_STEPS`` logged steps in a row (then a warning: a branch used now and then, a block
dropped by stochastic depth, a zero-initialised partner, a layer small by design all show
them for a while); no change at the step is information where the update is below the
parameter's floating-point resolution or its learning rate is 0, and an error otherwise.

    findings_over_steps(read_run("runs/mine").modules())
    rec.findings()     # gradrepro.record: also knows what is frozen and what the optimizer holds
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import pandas as pd
import torch

from gradrepro.diagnose.report import ERROR, INFO, WARNING, Finding
from gradrepro.diagnose.severity import PERSIST_STEPS, below_resolution
from gradrepro.records.run import parameter_names

# kind, the probe's state (or "not_updated"), what it means
_STATES = (
    ("no_gradient", "none", "no gradient (.grad is None: no graph path from the loss)"),
    ("zero_gradient", "zero", "an exactly zero gradient"),
    ("nonfinite_gradient", "nonfinite", "a NaN or Inf gradient"),
    ("tiny_gradient", "tiny", "a tiny gradient (grad/param ratio far below the model's median)"),
    ("not_updated", "not_updated", "a finite gradient but no change at the step"),
)
_PERSISTENT = {
    "no_gradient": "unused by the loss at every one of them: an auxiliary head or branch the loss leaves out? Nothing "
                   "to fix if on purpose; DistributedDataParallel then needs find_unused_parameters=True",
    "zero_gradient": "a dead unit, a multiplication by zero or a step function, not a start-up pattern",
    "tiny_gradient": "attenuated on every one of them, not only at the start",
}


def longest_run(hits: np.ndarray) -> int:
    """The most consecutive True values (logged steps in a row)."""
    best = run = 0
    for h in hits:
        run = run + 1 if h else 0
        best = max(best, run)
    return best


def findings_over_steps(modules: pd.DataFrame, frozen: Collection[str] = (),
                        outside_optimizer: Collection[str] = (),
                        updates: Mapping[str, tuple[float, torch.dtype]] | None = None) -> list[Finding]:
    """One finding per (parameter, kind) over the logged steps of ``modules``. ``frozen``:
    names with requires_grad=False (information, nothing else said); ``outside_optimizer``:
    trainable names no param group holds (an error); ``updates``: name -> (its param group's
    learning rate, its dtype), to tell an update below the dtype's resolution from a missing one."""
    if modules.empty:
        return []
    updates = updates or {}
    df = modules.assign(name=parameter_names(modules)).sort_values("step", kind="stable")
    stepped = df["grad_state"].isin(["finite", "tiny"])
    df["state_or_update"] = np.where(stepped & (df["update_to_param"] == 0), "not_updated", df["grad_state"])
    # Only a parameter with a state of _STATES at some step (or frozen, or outside the optimizer)
    # has a finding: the per-parameter pass below runs over those alone (all their rows, so the
    # parameters keep the order of their first logged step); a healthy model's are few.
    hit = df["grad_state"].isin([state for _, state, _ in _STATES]) | (df["state_or_update"] == "not_updated")
    named = set(df.loc[hit, "name"]) | (set(frozen) | set(outside_optimizer))
    df = df[df["name"].isin(named)]
    findings = []
    for name, rows in df.groupby("name", sort=False):
        steps = rows["step"].to_numpy()
        if name in frozen:
            findings.append(Finding("frozen", name, "requires_grad=False: it does not train", INFO))
            continue
        if name in outside_optimizer:
            findings.append(Finding("not_in_optimizer", name, "trainable and registered, but no param group holds "
                                    "it (compared by identity)", ERROR))
        for kind, state, meaning in _STATES:
            hits = (rows["grad_state"] == state if state != "not_updated" else rows["state_or_update"] == state)
            hits = hits.to_numpy()
            found = int(hits.sum())
            if not found:
                continue
            every = found == len(rows)
            at = steps[hits]
            detail = (f"{meaning} at {'every one' if every else found} of the {len(rows)} logged steps"
                      + (f" (steps {at[0]}..{at[-1]})" if every else f" (first at step {at[0]}, last at {at[-1]})"))
            severity, why = _severity(kind, name, rows[hits], longest_run(hits), outside_optimizer, updates)
            findings.append(Finding(kind, name, detail + why, severity))
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return sorted(findings, key=lambda f: order[f.severity])


def _severity(kind: str, name: str, hit_rows: pd.DataFrame, run: int, outside: Collection[str],
              updates: Mapping[str, tuple[float, torch.dtype]]) -> tuple[str, str]:
    """The severity of one (parameter, kind) and the words that say why (``severity``)."""
    if kind == "nonfinite_gradient":
        return ERROR, ""
    if kind == "not_updated":
        if name in outside:
            return ERROR, ""
        lr, dtype = updates.get(name, (np.nan, None))
        if lr == 0:
            return (WARNING, f"; its param group's learning rate is 0 at {run} logged steps in a row") \
                if run >= PERSIST_STEPS else (INFO, "; its param group's learning rate is 0 (a warm-up?)")
        if dtype is not None and np.isfinite(lr) and all(
                below_resolution(lr * float(g), float(p), dtype)
                for g, p in zip(hit_rows["grad_norm"], hit_rows["param_norm"])):
            return INFO, (f"; an SGD-sized step (lr x gradient norm) is below half an ulp of the tensor's norm in "
                          f"{str(dtype).replace('torch.', '')}: rounding, not a bug")
        return ERROR, ""
    if run >= PERSIST_STEPS:
        return WARNING, f"; {run} logged steps in a row: {_PERSISTENT[kind]}"
    return INFO, (f"; information until it holds at {PERSIST_STEPS} logged steps in a row (healthy models show it "
                  "for a while: routing, stochastic depth, zero-initialised partners, layers small by design)")
