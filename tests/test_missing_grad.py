"""The missing_grad/* experiments end to end: one multirun of the real CLI at scale=tiny over all
of them; every failure reproduces, its repaired control does not (its own healthy signature
holds instead), and each failure differs from its control in one knob."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_config, experiment_names, read_tables
from omegaconf import OmegaConf

from gradrepro.records.run import RunRecords
from gradrepro.signature import evaluate

NAMES = [n for n in experiment_names() if n.startswith("missing_grad/")]
FAILURES = [n for n in NAMES if not n.endswith("_repaired") and n not in
            ("missing_grad/healthy", "missing_grad/nonleaf_grad", "missing_grad/eval_mode")]
HEALTHY = [n for n in NAMES if n not in FAILURES]
CAUSES = ["unregistered_list", "tensor_attribute", "stale_optimizer", "detached", "no_grad", "tensor_rebuild",
          "unused_branch", "frozen", "forgotten_zero_grad"]


def test_every_cause_of_the_issue_has_a_failure_and_a_repaired_control():
    assert sorted(FAILURES) == sorted(f"missing_grad/{c}" for c in CAUSES)
    for cause in CAUSES:
        assert f"missing_grad/{cause}_repaired" in HEALTHY
    assert {"missing_grad/nonleaf_grad", "missing_grad/eval_mode"} <= set(HEALTHY)


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def runs(tiny_runs):
    """The missing_grad runs of the session's scale=tiny multirun: {name: run folder}."""
    return {name: tiny_runs[name] for name in NAMES}


def _records(run_dir: Path) -> RunRecords:
    summary, scalars, modules = read_tables(run_dir)
    return RunRecords(scalars, modules, summary.get("constants", {}))


def _signature(name: str):
    return _plain(compose_config([f"experiment={name}", "scale=tiny"]))["signature"]


def test_every_run_writes_the_usual_run_directory(runs):
    for name, run_dir in runs.items():
        summary, scalars, modules = read_tables(run_dir)
        assert summary["status"] == "completed", name
        assert len(modules) and {"grad_state", "grad_norm", "module", "param"} <= set(modules.columns), name
        assert {"expected_found", "unexpected_findings", "update_matches", "derivative_rel_err"} <= set(scalars)


@pytest.mark.parametrize("name", FAILURES)
def test_failure_reproduces_and_its_repaired_control_does_not(runs, name):
    summary = json.loads((runs[name] / "summary.json").read_text())
    control = summary["control"]
    assert summary["reproduced"], summary["checks"]
    assert not evaluate(_signature(name), _records(runs[control])).reproduced
    # The control passes its own, healthy signature: nothing flagged, the update matches the
    # optimizer's rule, autograd matches finite differences.
    assert json.loads((runs[control] / "summary.json").read_text())["reproduced"]


@pytest.mark.parametrize("name", ["missing_grad/healthy", "missing_grad/nonleaf_grad", "missing_grad/eval_mode"])
def test_healthy_controls_hold_and_their_signature_can_fail(runs, name):
    assert json.loads((runs[name] / "summary.json").read_text())["reproduced"]
    assert not evaluate(_signature(name), _records(runs["missing_grad/detached"])).reproduced
