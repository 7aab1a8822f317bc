"""The flip, measured: for every empirical failure experiment, the failure and its control at the
default scale on the seeds no knob was chosen on (``report.SEEDS_BY_KIND['empirical']``), each with the
reference runs it makes itself. Each evidence check must hold on the failure and fail on the
control on every seed; n/a on the control (it could not answer) fails the test too. Slow (minutes
per pair on 2 cores): ``pytest -m slow``. The same runs are what ``python -m gradrepro.report``
puts in results/README.md's margins table, which ``tests/test_results_current.py`` keeps current.

Mechanism experiments are not here: their evidence follows from the config by construction
(``DEMONSTRATED``), and their tiny-scale runs in the default suite show it."""

from __future__ import annotations

import pytest
from conftest import composed, experiment_names, multirun

from gradrepro.analysis.compare import compare
from gradrepro.analysis.report import SEEDS_BY_KIND

DEFAULT_SEEDS = SEEDS_BY_KIND["empirical"]


def empirical_failures():
    """Failures whose evidence is a measurement (a paper's, or an observation of ours)."""
    return [e for e in experiment_names()
            if composed(e).control and composed(e).claim_kind in ("empirical", "observation")]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", empirical_failures())
def test_each_evidence_check_holds_on_the_failure_and_fails_on_its_control(experiment, tmp_path):
    control = composed(experiment).control
    multirun(tmp_path / "sweep", f"experiment={experiment},{control}",
             f"seed={','.join(map(str, DEFAULT_SEEDS))}", "threads=1", timeout=7200)
    tables, _, _ = compare([tmp_path / "sweep"])
    evidence = tables["checks"].query("role == 'evidence' and experiment == @experiment")
    assert len(evidence) == len(DEFAULT_SEEDS) * sum(
        (c.get("role") or "evidence") == "evidence" for c in composed(experiment).signature.checks)
    for row in evidence.itertuples():
        where = f"{row.experiment} {row.check} seed {row.seed}: failure {row.observed_failure}, " \
                f"control {row.observed_control} ({row.note})"
        assert row.ok_failure, where
        assert row.ok_control is False, where  # fails on the control; n/a would not do
