"""gradrepro.lightning.Record under Lightning's strategy="ddp" on CPU, two processes: the
record equals a one-process fit on the same global batches. Lightning starts the second
process by running the script again, so the fit runs as a script in a subprocess (slow: two
Lightning imports)."""

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
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    out, devices, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=devices,
                         strategy="ddp" if devices > 1 else "auto", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[Record(out, every=1, activations=False)])
    # Each process takes its half of every global batch of 16 (rank r: entries 8r..8r+7).
    rank = trainer.global_rank
    mine = [16 * k + batch * rank + j for k in range(4) for j in range(batch)]
    data = torch.utils.data.TensorDataset(*(t[mine] for t in data.tensors))
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=batch))
''')


def fit(tmp_path, name, devices, batch):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    # Its own session: Lightning's second process is a grandchild, killed with the group.
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / name), str(devices), str(batch)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
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
    return pd.read_parquet(tmp_path / name / "modules.parquet")


@pytest.mark.slow
def test_lightning_ddp_records_what_one_process_records_on_the_global_batch(tmp_path):
    one = fit(tmp_path, "one", 1, 16)
    ddp = fit(tmp_path, "ddp", 2, 8)
    assert not (tmp_path / "ddp-rank1").exists()
    assert list(ddp["step"]) == list(one["step"]) and list(ddp["module"]) == list(one["module"])
    for column in ("grad_norm", "param_norm", "update_to_param", "grad_std", "frac_zero"):
        np.testing.assert_allclose(ddp[column], one[column], rtol=1e-5, atol=1e-8, err_msg=column)
