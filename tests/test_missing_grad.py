"""The missing_grad/* experiments end to end: one multirun of the real CLI at scale=tiny over all
of them; every failure reproduces, its repaired control does not (its own healthy signature
holds instead), and each failure differs from its control in one knob."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gradrepro.signature import RunRecords, evaluate
from gradrepro.store import read_run
from tests.conftest import ROOT, compose_config, experiment_names

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


@pytest.mark.parametrize("name", FAILURES)
def test_failure_changes_one_knob_from_its_control(name):
    fail = _plain(compose_config([f"experiment={name}"]))
    ctrl = _plain(compose_config([f"experiment={fail['control']}"]))
    for key in ("name", "control", "claim", "signature", "paper"):
        fail.pop(key), ctrl.pop(key)

    def leaves(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = leaves(fail), leaves(ctrl)
    assert len([k for k in set(a) | set(b) if a.get(k) != b.get(k)]) == 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One multirun over every missing_grad experiment at scale=tiny: {name: run directory}."""
    sweep = tmp_path_factory.mktemp("missing_grad")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "gradrepro", "-m", f"experiment={','.join(NAMES)}", "scale=tiny",
         f"hydra.sweep.dir={sweep}"],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for summary in Path(sweep).rglob("summary.json"):
        found[json.loads(summary.read_text())["experiment"]] = summary.parent
    assert sorted(found) == sorted(NAMES)
    return found


def _records(run_dir: Path) -> RunRecords:
    summary, scalars, modules = read_run(run_dir)
    return RunRecords(scalars, modules, summary.get("constants", {}))


def _signature(name: str):
    return _plain(compose_config([f"experiment={name}", "scale=tiny"]))["signature"]


def test_every_run_writes_the_usual_run_directory(runs):
    for name, run_dir in runs.items():
        summary, scalars, modules = read_run(run_dir)
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
