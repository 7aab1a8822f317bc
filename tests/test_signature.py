"""Verdicts are decided by evidence checks; context checks are shown and never decide."""

from __future__ import annotations

import pandas as pd
import pytest
from conftest import compose_config

from gradrepro.config.validate import validate
from gradrepro.errors import UserError
from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate, format_verdict

RECORDS = RunRecords(pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.0, 0.5]}), pd.DataFrame(), {"c": 3.0})


def signature(*checks):
    return {"window": 1, "checks": list(checks)}


def test_a_failing_context_check_does_not_decide_the_verdict():
    verdict = evaluate(signature({"metric": "loss", "op": "<=", "threshold": 1.0},
                                 {"metric": "c", "op": ">=", "threshold": 10, "role": "context"}), RECORDS)
    assert verdict.reproduced
    assert [c.ok for c in verdict.checks] == [True, False]
    assert [c.role for c in verdict.checks] == ["evidence", "context"]
    assert "context" in format_verdict(verdict, "x")


def test_a_failing_evidence_check_decides_and_context_alone_never_reproduces():
    failing = {"metric": "loss", "op": ">=", "threshold": 1.0}
    assert not evaluate(signature(failing, {"metric": "c", "op": ">=", "threshold": 1, "role": "context"}),
                        RECORDS).reproduced
    assert not evaluate(signature({"metric": "c", "op": ">=", "threshold": 1, "role": "context"}),
                        RECORDS).reproduced


def test_an_unknown_role_is_one_line_naming_the_choices():
    cfg = compose_config(["experiment=simsiam_nostopgrad", "scale=tiny", "signature.checks.0.role=evidnce"])
    with pytest.raises(UserError, match=r"role='evidnce' is not valid; choose one of: evidence, context"):
        validate(cfg)
