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
from typing import Any, Optional

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


class StepStates:
    """Per parameter, its states over the logged steps so far, kept as counts as the steps
    arrive (``add``), so that ``findings()`` costs the same at the thousandth logged step as at
    the first: a recorder asked for its findings at every log (the Trainer's ``on_log``) would
    otherwise reread every row so far each time. Per (parameter, kind): rows, hits, the first
    and last step hit, the current and the longest run of hits in a row; for ``not_updated``
    also the hit rows' gradient and parameter norms (few: a healthy model has none)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # parameter name -> slot, in the order first seen
        self.steps: set = set()  # logged steps seen
        self.has_states = False  # some block carried the probe's grad_state column
        n = len(_STATES)
        self.rows = np.zeros(0, dtype=np.int64)
        self.found, self.run, self.best = (np.zeros((n, 0), dtype=np.int64) for _ in range(3))
        self.first, self.last = np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0), dtype=np.int64)
        self.still: dict[int, list[tuple[float, float]]] = {}  # slot -> (grad, param norms) of its not_updated rows

    def add(self, block: Mapping[str, Any]) -> "StepStates":
        """Rows of ``modules.parquet`` (a frame, or one logged step's columns as the probe gives
        them), taken in step order and, within a step, in their own order."""
        step = np.asarray(block["step"]).astype(np.int64)
        if not len(step):
            return self
        names = parameter_names(block)
        has_states = "grad_state" in block
        n = len(step)
        state = np.asarray(block["grad_state"], dtype=object) if has_states else np.full(n, None, dtype=object)
        update, grad, param = (np.asarray(block[key], dtype=float) if key in block else np.full(n, np.nan)
                               for key in ("update_to_param", "grad_norm", "param_norm"))
        order = np.argsort(step, kind="stable")
        step, names, state, update, grad, param = (a[order] for a in (step, names, state, update, grad, param))
        # A name twice in one step (rare): its rows are taken in order, one occurrence at a time.
        if step[0] == step[-1] and len(set(names)) == n:  # one logged step's columns: the usual case
            occurrence = np.zeros(n, dtype=np.int64)
        else:
            occurrence = pd.Series(names).groupby([step, names], sort=False).cumcount().to_numpy()
        if occurrence.any():
            groups = np.lexsort((occurrence, step))
            step, names, state, update, grad, param, occurrence = (
                a[groups] for a in (step, names, state, update, grad, param, occurrence))
        cuts = np.flatnonzero((step[1:] != step[:-1]) | (occurrence[1:] != occurrence[:-1])) + 1
        for part in np.split(np.arange(n), cuts) if len(cuts) else (slice(None),):  # one step: no copies
            self._add_rows(names[part], step[part], state[part] if has_states else None, update[part],
                           grad[part], param[part])
        return self

    def _add_rows(self, names: np.ndarray, step: np.ndarray, state: Optional[np.ndarray], update: np.ndarray,
                  grad: np.ndarray, param: np.ndarray) -> None:
        """One logged step's rows, each parameter at most once."""
        slot = np.array([self._slot(name) for name in names], dtype=np.int64)
        self.steps.update(np.unique(step).tolist())
        self.rows[slot] += 1
        if state is None:
            self.run[:, slot] = 0
            return
        self.has_states = True
        stepped = (state == "finite") | (state == "tiny")
        for k, (_, wanted, _) in enumerate(_STATES):
            hits = stepped & (update == 0) if wanted == "not_updated" else state == wanted
            run = (self.run[k, slot] + 1) * hits
            self.run[k, slot] = run
            self.best[k, slot] = np.maximum(self.best[k, slot], run)
            self.first[k, slot] = np.where(hits & (self.found[k, slot] == 0), step, self.first[k, slot])
            self.last[k, slot] = np.where(hits, step, self.last[k, slot])
            self.found[k, slot] += hits
            if wanted == "not_updated":
                for i in np.flatnonzero(hits):
                    self.still.setdefault(int(slot[i]), []).append((float(grad[i]), float(param[i])))

    def _slot(self, name: str) -> int:
        slot = self.index.get(name)
        if slot is None:
            slot = self.index[name] = len(self.index)
            if slot >= len(self.rows):  # room for twice as many parameters
                grow = max(2 * len(self.rows), 16) - len(self.rows)
                self.rows = np.concatenate([self.rows, np.zeros(grow, dtype=np.int64)])
                for key in ("found", "run", "best", "first", "last"):
                    old = getattr(self, key)
                    setattr(self, key, np.concatenate([old, np.zeros((old.shape[0], grow), dtype=np.int64)], axis=1))
        return slot

    def findings(self, frozen: Collection[str] = (), outside_optimizer: Collection[str] = (),
                 updates: Mapping[str, tuple[float, torch.dtype]] | None = None) -> list[Finding]:
        """``findings_over_steps``' findings of the rows added so far."""
        if not self.has_states:
            return []
        updates = updates or {}
        frozen, outside_optimizer = set(frozen), set(outside_optimizer)
        n = len(self.index)
        named = self.found[:, :n].any(axis=0)
        findings = []
        for name, slot in self.index.items():
            if not (named[slot] or name in frozen or name in outside_optimizer):
                continue
            if name in frozen:
                findings.append(Finding("frozen", name, "requires_grad=False: it does not train", INFO))
                continue
            if name in outside_optimizer:
                findings.append(Finding("not_in_optimizer", name, "trainable and registered, but no param group holds "
                                        "it (compared by identity)", ERROR))
            rows = int(self.rows[slot])
            for k, (kind, _, meaning) in enumerate(_STATES):
                found = int(self.found[k, slot])
                if not found:
                    continue
                every = found == rows
                first, last = int(self.first[k, slot]), int(self.last[k, slot])
                detail = (f"{meaning} at {'every one' if every else found} of the {rows} logged steps"
                          + (f" (steps {first}..{last})" if every else f" (first at step {first}, last at {last})"))
                severity, why = _severity(kind, name, self.still.get(slot, []), int(self.best[k, slot]),
                                          outside_optimizer, updates)
                findings.append(Finding(kind, name, detail + why, severity))
        order = {ERROR: 0, WARNING: 1, INFO: 2}
        return sorted(findings, key=lambda f: order[f.severity])


def findings_over_steps(modules: pd.DataFrame, frozen: Collection[str] = (),
                        outside_optimizer: Collection[str] = (),
                        updates: Mapping[str, tuple[float, torch.dtype]] | None = None) -> list[Finding]:
    """One finding per (parameter, kind) over the logged steps of ``modules``. ``frozen``:
    names with requires_grad=False (information, nothing else said); ``outside_optimizer``:
    trainable names no param group holds (an error); ``updates``: name -> (its param group's
    learning rate, its dtype), to tell an update below the dtype's resolution from a missing one."""
    if modules.empty or "grad_state" not in modules:
        return []
    return StepStates().add(modules).findings(frozen, outside_optimizer, updates)


def _severity(kind: str, name: str, still: list[tuple[float, float]], run: int, outside: Collection[str],
              updates: Mapping[str, tuple[float, torch.dtype]]) -> tuple[str, str]:
    """The severity of one (parameter, kind) and the words that say why (``severity``);
    ``still``: the gradient and parameter norms of its rows without a change at the step."""
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
                for g, p in still):
            return INFO, (f"; an SGD-sized step (lr x gradient norm) is below half an ulp of the tensor's norm in "
                          f"{str(dtype).replace('torch.', '')}: rounding, not a bug")
        return ERROR, ""
    if run >= PERSIST_STEPS:
        return WARNING, f"; {run} logged steps in a row: {_PERSISTENT[kind]}"
    return INFO, (f"; information until it holds at {PERSIST_STEPS} logged steps in a row (healthy models show it "
                  "for a while: routing, stochastic depth, zero-initialised partners, layers small by design)")
