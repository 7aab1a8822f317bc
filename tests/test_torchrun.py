"""The examples under examples/ launched as their pages say, with ``torchrun --nproc_per_node=2``
on CPU (gloo): DDP, FSDP2, the Hugging Face Trainer and an Accelerate loop each write one run
folder (rank 0's) whose per-module statistics are those of one process on the same global
batches. Each launch has a timeout and its own process group, killed whole at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT

# Each launch starts torchrun and two interpreters that import torch (and transformers): slow on
# a busy 2-core machine, so out of the default run.
pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"


def launch(tmp_path, script, run, *args, processes=2, timeout=300):
    """Run ``script`` under torchrun with ``processes`` processes; its modules table."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
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
    assert not (tmp_path / f"{run}-rank1").exists()  # rank 0 writes, the others nothing
    return pd.read_parquet(tmp_path / run / "modules.parquet"), out


def same(many, one, columns=("grad_norm", "param_norm", "update_to_param")):
    assert list(many["step"]) == list(one["step"]) and list(many["module"]) == list(one["module"])
    for column in columns:
        np.testing.assert_allclose(many[column], one[column], rtol=1e-5, atol=1e-8, err_msg=column)


@pytest.mark.parametrize("script", ["torchrun_ddp.py", "torchrun_fsdp2.py"])
def test_torchrun_examples_record_the_global_batch_on_two_processes(tmp_path, script):
    many, _ = launch(tmp_path, script, "two", "--steps", "8", "--every", "4")
    one, _ = launch(tmp_path, script, "one", "--steps", "8", "--every", "4", processes=1)
    assert sorted(many["step"].unique()) == [0, 4, 7]
    same(many, one)


def test_trainer_on_two_processes_records_what_one_process_records(tmp_path):
    many, _ = launch(tmp_path, "trainer.py", "two", "--model", "classifier", "--batch", "2", "--steps", "4")
    one, _ = launch(tmp_path, "trainer.py", "one", "--model", "classifier", "--batch", "4", "--steps", "4",
                    processes=1)
    assert many["step"].nunique() == 4
    moved = ~(many["module"].str.endswith("attention.self.key") & (many["param"] == "bias"))  # see test_transformers
    same(many[moved], one[moved])


def test_accelerate_loop_on_two_processes_records_what_one_process_records(tmp_path):
    many, _ = launch(tmp_path, "accelerate_loop.py", "two", "--model", "classifier", "--batch", "2", "--steps", "4")
    one, _ = launch(tmp_path, "accelerate_loop.py", "one", "--model", "classifier", "--batch", "4", "--steps", "4",
                    processes=1)
    moved = ~(many["module"].str.endswith("attention.self.key") & (many["param"] == "bias"))
    same(many[moved], one[moved])
