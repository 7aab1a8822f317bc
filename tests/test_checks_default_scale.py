"""Every failure experiment beside its control at the default scale, on one seed nobody tuned
on (seed 3): each evidence check holds on the failure and fails on the control, except the
headline accuracy of the SimSiam predictor ablations, which does not reproduce at our scale
(experiments/simsiam.md). Slow (tens of minutes on 2 cores): ``pytest -m slow``."""

from __future__ import annotations

import pytest
from conftest import compose_config, experiment_names, multirun

from gradrepro.analysis.compare import compare

SEED = 3
# (experiment, check) that hold nowhere at our scale: the verdict says NOT REPRODUCED.
NOT_REPRODUCED = {("simsiam_nopredictor", "0: knn_acc"), ("simsiam_frozen_predictor", "0: knn_acc")}


@pytest.mark.slow
def test_every_evidence_check_holds_on_its_failure_and_fails_on_its_control(tmp_path):
    names = [e for e in experiment_names()
             if compose_config([f"experiment={e}"]).control or any(
                 compose_config([f"experiment={f}"]).control == e for f in experiment_names())]
    multirun(tmp_path / "sweep", f"experiment={','.join(names)}", f"seed={SEED}", "threads=1", timeout=7200)
    tables, _, _ = compare([tmp_path / "sweep"])
    evidence = tables["checks"].query("role == 'evidence'")
    assert set(evidence["experiment"]) == {e for e in names if compose_config([f"experiment={e}"]).control}
    for row in evidence.itertuples():
        where = f"{row.experiment} {row.check}: failure {row.observed_failure}, control {row.observed_control}"
        if (row.experiment, row.check) in NOT_REPRODUCED:
            assert not row.ok_failure, where
            continue
        assert row.ok_failure, where
        assert row.ok_control is False, where  # fails on the control; n/a would not do
