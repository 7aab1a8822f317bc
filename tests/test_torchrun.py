"""The examples under examples/ launched as their pages say, with ``torchrun --nproc_per_node=2``
on CPU (gloo), each writing one run folder (rank 0's) with one row per optimizer step: DDP and
FSDP2 record what one process records on the same global batches; the Hugging Face Trainer and
an Accelerate loop record the per-module gradient norms of their loop written out in plain torch
on the same model, data and accumulation (rtol 1e-5). Each launch has a timeout and its own
process group, killed whole at the end.

Each launch starts torchrun and two interpreters that import torch (and transformers): the
Trainer's classifier runs in the default run, the others are marked slow."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import hf_tiny
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT

EXAMPLES = ROOT / "examples"


def launch(tmp_path, script, run, *args, processes=2, timeout=300):
    """Run ``script`` under torchrun with ``processes`` processes; its modules table."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    before = set(tmp_path.rglob("summary.json"))
    proc = subprocess.Popen([*prefix, str(EXAMPLES / script), str(tmp_path / run), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        # torchrun starts each worker in a session of its own: SIGTERM makes torchrun stop them
        # (a SIGKILL to torchrun's group would leave them running), then whatever is left goes.
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    written = set(tmp_path.rglob("summary.json")) - before
    assert [p.parent.name for p in written] == [run]  # rank 0 writes, the others nothing
    return pd.read_parquet(tmp_path / run / "modules.parquet"), out


def example(name):
    """An example script as a module (its model and data builders)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same(many, one, columns=("grad_norm", "param_norm", "update_to_param")):
    assert list(many["step"]) == list(one["step"]) and list(many["module"]) == list(one["module"])
    for column in columns:
        np.testing.assert_allclose(many[column], one[column], rtol=1e-5, atol=1e-8, err_msg=column)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ddp.py", "torchrun_fsdp2.py"])
def test_torchrun_examples_record_the_global_batch_on_two_processes(tmp_path, script):
    many, _ = launch(tmp_path, script, "two", "--steps", "8", "--every", "4")
    one, _ = launch(tmp_path, script, "one", "--steps", "8", "--every", "4", processes=1)
    assert sorted(many["step"].unique()) == [0, 4, 7]
    same(many, one)


@pytest.mark.parametrize("kind", ["classifier", pytest.param("causal_lm", marks=pytest.mark.slow)])
def test_trainer_on_two_processes_records_its_loop_written_out(tmp_path, kind):
    """examples/trainer.py on 2 processes, micro-batches of 2, accumulation 2, against
    hf_tiny.plain_loop with the 2x2 micro-batches of 2 one after another (the Trainer's item count
    over both processes, its loss times the world size, DDP's mean: the losses add up). The
    classifier's loss is a mean that ignores ``num_items_in_batch``, so the Trainer's gradient on
    2 processes is twice its gradient on one: the record shows it, as the plain loop has it."""
    many, _ = launch(tmp_path, "trainer.py", "two", "--model", kind, "--batch", "2", "--steps", "4")
    torch.set_num_threads(1)
    source = example("accelerate_loop")
    hf_tiny.plain_loop(kind, tmp_path / "plain", steps=4, batch=2, accumulate=4, model_fn=source.build,
                       dataset=source.batches(kind))
    plain = pd.read_parquet(tmp_path / "plain" / "modules.parquet")
    assert list(many["step"]) == list(plain["step"]) and many["step"].nunique() == 4  # one row per optimizer step
    assert list(many["module"]) == list(plain["module"]) and list(many["param"]) == list(plain["param"])
    np.testing.assert_allclose(many["grad_norm"], plain["grad_norm"], rtol=1e-5, atol=1e-8)
    moved = ~(many["module"].str.endswith("attention.self.key") & (many["param"] == "bias"))  # see test_transformers
    same(many[moved], plain[moved], columns=("param_norm", "update_to_param"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["classifier", "causal_lm"])
def test_accelerate_loop_on_two_processes_records_its_loop_written_out(tmp_path, kind):
    """examples/accelerate_loop.py on 2 processes, micro-batches of 2, accumulation 2, against
    hf_tiny.mean_loop on one process with micro-batches of 4 (the same global micro-batches)."""
    many, _ = launch(tmp_path, "accelerate_loop.py", "two", "--model", kind, "--batch", "2", "--steps", "4")
    torch.set_num_threads(1)
    source = example("accelerate_loop")
    hf_tiny.mean_loop(kind, tmp_path / "plain", steps=4, batch=4, model_fn=source.build, dataset=source.batches(kind))
    plain = pd.read_parquet(tmp_path / "plain" / "modules.parquet")
    assert many["step"].nunique() == 4
    np.testing.assert_allclose(many["grad_norm"], plain["grad_norm"], rtol=1e-5, atol=1e-8)
    moved = ~(many["module"].str.endswith("attention.self.key") & (many["param"] == "bias"))
    same(many[moved], plain[moved])
