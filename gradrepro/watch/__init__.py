"""The watch: the checks ``gradrepro.record`` makes on every step of a running loop.

``gradrepro.diagnose`` examines one controlled transition of a model, on demand. The watch
runs beside the user's own loop, step after step, and reports what it sees at the logged step
it first appears (a *live finding*), with the same ``Finding`` fields and next checks as
``diagnose``. Its modules:

- ``watcher``: ``Watch``, wired into the recorder's hooks; reports each live finding once
  (warning, raise or log) and writes ``findings.json``;
- ``checks``: the per-step checks read from the probe's columns and the model's modules
  (modes, membership, frozen normalisation statistics, stale gradients);
- ``invariants``: properties every correct step keeps (no change between steps, a frozen
  tensor stays put, each backward starts from the gradient the loop intends, training flags),
  from a cheap fingerprint per tensor;
- ``carried``: stale gradients on every step, logged or not, from a few tensors' gradient hooks;
- ``rule_check``: each update against what its optimizer's rule makes of the gradient;
- ``over_steps``: the summary over a run's logged steps, read back from ``modules.parquet``.

The severity policy (a contradiction at once; a pattern healthy code shows only once it
persists) is shared with ``diagnose``: ``gradrepro.diagnose.severity``.
"""

from __future__ import annotations

from gradrepro.watch.over_steps import findings_over_steps
from gradrepro.watch.watcher import KINDS, FindingError, LiveFinding, TrainingFinding, Watch

__all__ = ["KINDS", "FindingError", "LiveFinding", "TrainingFinding", "Watch", "findings_over_steps"]
