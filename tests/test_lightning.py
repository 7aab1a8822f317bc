"""gradrepro.lightning.Record inside Trainer.fit: a tiny LightningModule on CPU writes the run
folder that compare reads, with one step per optimizer step (gradient accumulation included)
and the gradients read after backward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

from conftest import ROOT  # noqa: E402 - after the skip

from gradrepro.analysis.compare import compare  # noqa: E402
from gradrepro.lightning import Record  # noqa: E402

torch.set_num_threads(1)


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        self.unused = torch.nn.Linear(8, 3)  # never called: no gradient at any step
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 96, batch: int = 16):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def fit(callback, max_steps: int, accumulate: int = 1) -> Tiny:
    model = Tiny()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, callbacks=[callback])
    trainer.fit(model, loader())
    return model


def test_callback_writes_a_run_folder_compare_reads(tmp_path):
    callback = Record(tmp_path / "runs" / "tiny", every=2)
    fit(callback, max_steps=5)
    run_dir = tmp_path / "runs" / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    scalars = pd.read_parquet(run_dir / "scalars.parquet")
    modules = pd.read_parquet(run_dir / "modules.parquet")
    assert summary["status"] == "completed" and summary["steps"] == 5 and summary["experiment"] == "tiny"
    assert list(scalars["step"]) == [0, 2, 4] and np.isfinite(scalars["loss"]).all()
    assert (scalars["grad_norm"] > 0).all() and (scalars["lr"] == 0.1).all()
    states = modules.groupby("module")["grad_state"].agg(set)
    assert states["net.0"] == {"finite"} and states["unused"] == {"none"}
    assert (run_dir / "signals.png").exists()
    found = {(f.kind, f.name) for f in callback.recorder.findings()}
    assert ("no_gradient", "unused.weight") in found and not {n for _, n in found} & {"net.0.weight"}
    tables, runs, warnings = compare([tmp_path / "runs"])
    assert not warnings and tables["runs"].iloc[0]["status"] == "completed"


def test_accumulated_batches_are_one_step_with_the_mean_loss(tmp_path):
    callback = Record(tmp_path / "acc", every=1)
    fit(callback, max_steps=3, accumulate=2)  # 6 batches, 3 optimizer steps
    scalars = pd.read_parquet(tmp_path / "acc" / "scalars.parquet")
    assert list(scalars["step"]) == [0, 1, 2]
    # step 0's loss: the mean of the first two batches' losses at the initial weights
    x, y = next(iter(torch.utils.data.DataLoader(loader().dataset, batch_size=32)))
    first = Tiny()
    expected = (F.cross_entropy(first.net(x[:16]), y[:16]) + F.cross_entropy(first.net(x[16:]), y[16:])) / 2
    assert scalars["loss"].iloc[0] == pytest.approx(float(expected.detach()), rel=1e-5)


def test_the_readme_examples_run_and_compare_reads_what_they_write(tmp_path):
    """The README's "Your own model" examples, run as written, in a fresh folder."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))
    script = tmp_path / "examples.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "diagnose: OK" in proc.stdout
    tables, runs, warnings = compare([tmp_path / "runs"])
    assert not warnings and sorted(r.experiment for r in runs) == ["lightning", "mine"]
    assert set(tables["runs"]["status"]) == {"completed"}
