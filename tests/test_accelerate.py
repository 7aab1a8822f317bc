"""gradrepro.record in an Accelerate loop (examples/accelerate_loop.py, one process): one row per
optimizer step with ``accumulate()``, the same per-module numbers as the loop written out in
plain torch, no warning on a healthy run, and each injected bug's finding at the step it acts."""

from __future__ import annotations

import importlib.util
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402

torch.set_num_threads(1)
_spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "examples" / "accelerate_loop.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def run_example(tmp_path, monkeypatch, *args):
    """The example's main() in this process: its warnings and its printed findings."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setattr(sys, "argv", ["accelerate_loop.py", str(tmp_path / "acc"), *args])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            example.main()
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    return [str(w.message) for w in caught if type(w.message).__name__ == "TrainingFinding"]


@pytest.mark.parametrize("kind", ["causal_lm", "classifier"])
def test_accelerate_loop_records_what_the_plain_loop_records_and_warns_of_nothing(kind, tmp_path, monkeypatch):
    found = run_example(tmp_path, monkeypatch, "--model", kind)
    assert not found, found
    hf_tiny.mean_loop(kind, tmp_path / "plain", model_fn=example.build, dataset=example.batches(kind))
    ours, theirs = (pd.read_parquet(tmp_path / n / "modules.parquet") for n in ("acc", "plain"))
    assert list(ours["step"]) == list(theirs["step"]) and ours["step"].nunique() == 8
    np.testing.assert_allclose(ours["grad_norm"], theirs["grad_norm"], rtol=1e-5, atol=1e-8)
    # BERT's key biases: a gradient 0 in exact arithmetic, turned by AdamW into noise-led updates
    moved = ~(ours["module"].str.endswith("attention.self.key") & (ours["param"] == "bias"))
    for column in ("param_norm", "update_to_param"):
        np.testing.assert_allclose(ours[column][moved], theirs[column][moved], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("bug,kind", [("lr_zero", "lr_zero"), ("frozen", "frozen_moved")])
def test_accelerate_loop_bug_is_found_at_the_step_it_acts(bug, kind, tmp_path, monkeypatch):
    found = run_example(tmp_path, monkeypatch, "--bug", bug)
    assert any(f"step 4: {kind}" in w for w in found), found  # the run's middle step, where the bug begins
    assert not any(f"step {s}: {kind}" in w for w in found for s in range(4))
    scalars = pd.read_parquet(tmp_path / "acc" / "scalars.parquet")
    assert list(scalars["step"]) == list(range(8))
