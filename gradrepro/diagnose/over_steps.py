"""``diagnose``-style findings from a run's records (``modules.parquet``), per parameter over
its logged steps: no gradient, exactly zero, tiny, non-finite, not updated. The states are
the probe's (``gradrepro.probe.states``); a state at every logged step is an error (tiny: a
warning), at some of them a warning, since a branch used now and then is legitimate.

    findings_over_steps(read_run("runs/mine").modules())
    rec.findings()     # gradrepro.record: also knows what is frozen and what the optimizer holds
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import pandas as pd

from gradrepro.diagnose.report import ERROR, INFO, WARNING, Finding
from gradrepro.records.run import parameter_names

# kind, the probe's state (or "not_updated"), what it means
_STATES = (
    ("no_gradient", "none", "no gradient (.grad is None: no graph path from the loss)"),
    ("zero_gradient", "zero", "an exactly zero gradient"),
    ("nonfinite_gradient", "nonfinite", "a NaN or Inf gradient"),
    ("tiny_gradient", "tiny", "a tiny gradient (grad/param ratio far below the model's median)"),
    ("not_updated", "not_updated", "a finite gradient but no change at the step"),
)


def findings_over_steps(modules: pd.DataFrame, frozen: Collection[str] = (),
                        outside_optimizer: Collection[str] = ()) -> list[Finding]:
    """One finding per (parameter, kind) over the logged steps of ``modules``. ``frozen``:
    names with requires_grad=False (information, nothing else said); ``outside_optimizer``:
    trainable names no param group holds (an error)."""
    if modules.empty:
        return []
    df = modules.assign(name=parameter_names(modules))
    stepped = df["grad_state"].isin(["finite", "tiny"])
    df["state_or_update"] = np.where(stepped & (df["update_to_param"] == 0), "not_updated", df["grad_state"])
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
            hits = rows["grad_state"] == state if state != "not_updated" else rows["state_or_update"] == state
            found = int(hits.sum())
            if not found:
                continue
            every = found == len(rows)
            severity = WARNING if kind == "tiny_gradient" or not every else ERROR
            if kind == "nonfinite_gradient":
                severity = ERROR
            at = steps[hits.to_numpy()]
            detail = (f"{meaning} at {'every one' if every else found} of the {len(rows)} logged steps"
                      + (f" (steps {at[0]}..{at[-1]})" if every else f" (first at step {at[0]}, last at {at[-1]})"))
            findings.append(Finding(kind, name, detail, severity))
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return sorted(findings, key=lambda f: order[f.severity])
