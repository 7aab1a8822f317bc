"""gradrepro.lightning.Record under Lightning's multi-process strategies on CPU, two processes:
`strategy="ddp"` and `ModelParallelStrategy` (Lightning's FSDP2 path: `fully_shard` in
`configure_model`) each record what a one-process fit records on the same global batches.
Lightning starts the second process by running the script again, so each fit runs as a script
in a subprocess. (Lightning's older `FSDPStrategy` refuses a CPU accelerator, so it is not run
here.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("lightning.pytorch")

SCRIPT = textwrap.dedent('''
    import sys
    import lightning.pytorch as pl
    import torch, torch.nn.functional as F
    from gradrepro.lightning import Record

    class Tiny(pl.LightningModule):
        def __init__(self, shard):
            super().__init__()
            torch.manual_seed(0)
            self.shard = shard
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        def configure_model(self):
            if not self.shard:
                return
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.shard:  # the parameters the optimizer steps are each process's shards
                assert all(type(p).__name__ == "DTensor" for p in self.parameters())
            return F.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    out, devices, batch, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=devices, strategy=strategy,
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[Record(out, every=1, activations=False)])
    # Each process takes its half of every global batch of 16 (rank r: entries 8r..8r+7).
    rank = trainer.global_rank
    mine = [16 * k + batch * rank + j for k in range(4) for j in range(batch)]
    data = torch.utils.data.TensorDataset(*(t[mine] for t in data.tensors))
    trainer.fit(Tiny(shard=sys.argv[4] == "fsdp2"), torch.utils.data.DataLoader(data, batch_size=batch))
''')


def fit(folder, name, devices, batch, strategy):
    script = folder / "fit.py"
    script.write_text(SCRIPT)
    # Its own session: Lightning's second process is a grandchild, killed with the group.
    proc = subprocess.Popen([sys.executable, str(script), str(folder / name), str(devices), str(batch), strategy],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        proc.wait(10)
    assert proc.returncode == 0, stderr[-3000:]
    return pd.read_parquet(folder / name / "modules.parquet")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("one"), "one", 1, 16, "auto")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_multi_process_records_what_one_process_records_on_the_global_batch(
        tmp_path, one_process, strategy):
    many = fit(tmp_path, strategy, 2, 8, strategy)
    assert not (tmp_path / f"{strategy}-rank1").exists()
    assert list(many["step"]) == list(one_process["step"]) and list(many["module"]) == list(one_process["module"])
    for column in ("grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero"):
        np.testing.assert_allclose(many[column], one_process[column], rtol=1e-5, atol=1e-8, err_msg=column)
