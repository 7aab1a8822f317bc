"""The recorder keeps the run-folder contract and records what happened, in any loop order:
it claims its folder as the CLI does (a folder holding a run, or held by another recording,
is refused in one line and left untouched), its fresh gradient is this step's backward alone
wherever ``zero_grad`` sits, ``rec.log`` cannot overwrite the columns it writes itself, the
last step gets a row as in the built-in runs, and a healthy model's findings say so."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradrepro
from gradrepro.errors import UserError
from gradrepro.record import RESERVED
from gradrepro.records import claim as claims

torch.set_num_threads(1)
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text.strip(), text
    return text


# --- one run, one folder ---------------------------------------------------------------------

@pytest.mark.parametrize("marker", claims.RUN_MARKERS)
def test_a_recording_into_a_folder_holding_a_run_is_refused_and_the_run_kept(tmp_path, marker):
    run = tmp_path / "run"
    (run / marker).parent.mkdir(parents=True, exist_ok=True)
    (run / marker).write_bytes(b"the earlier run's record")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    model = mlp()
    with pytest.raises(UserError) as refused:
        gradrepro.record(model, torch.optim.SGD(model.parameters(), lr=0.1), run)
    assert "already holds a run" in one_line(refused.value) and marker in str(refused.value)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_two_recordings_on_one_folder_the_second_is_refused(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1) as first:
        with pytest.raises(UserError) as refused:
            gradrepro.record(mlp(1), opt, tmp_path / "." / "run")  # another spelling of the same folder
        assert "in use" in one_line(refused.value)
        x, y = batch(0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert first.status == "completed" and not (tmp_path / "run" / claims.LOCK).exists()
    with pytest.raises(UserError):  # and once written, it holds a run
        gradrepro.record(model, opt, tmp_path / "run")


def test_a_home_relative_folder_is_the_folder_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model = mlp()
    with gradrepro.record(model, torch.optim.SGD(model.parameters(), lr=0.1), "~/runs/mine") as rec:
        pass
    assert rec.run_dir == tmp_path / "home" / "runs" / "mine"
    assert (rec.run_dir / "summary.json").exists() and not (tmp_path / "~").exists()


def test_the_lightning_callback_refuses_a_folder_holding_a_run_before_training(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from gradrepro.lightning import Record

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    with pytest.raises(UserError) as refused:
        Record(tmp_path / "run")
    assert "already holds a run" in one_line(refused.value)
    assert (tmp_path / "run" / "summary.json").read_text() == "{}"


# --- the fresh gradient in any loop order ------------------------------------------------------

ORDERS = ("zero_grad, forward, backward, step",  # the tutorial order
          "forward, zero_grad, backward, step",  # loss = f(model(x)); opt.zero_grad(); ...
          "forward, backward, step (no zero_grad)")  # a running sum in .grad


@FAST
@given(order=st.sampled_from(ORDERS), micro=st.integers(1, 3), steps=st.integers(2, 5), every=st.integers(1, 3),
       seed=st.integers(0, 50))
def test_the_fresh_gradient_is_this_steps_backward_in_any_loop_order(tmp_path_factory, order, micro, steps,
                                                                     every, seed):
    run = tmp_path_factory.mktemp("order") / "run"
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = {}  # step -> (norm of .grad before the optimizer step, norm of this step's backward alone)
    with gradrepro.record(model, opt, run, every=every, activations=False):
        for step in range(steps):
            if order.startswith("zero_grad"):
                opt.zero_grad()
            micro_batches = [batch(seed + 10 * step + k) for k in range(micro)]
            losses = [F.cross_entropy(model(x), y) / micro for x, y in micro_batches]
            if order.startswith("forward, zero_grad"):
                opt.zero_grad()
            before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            for loss in losses:
                loss.backward()
            after = [p.grad.clone() for p in model.parameters()]
            expected[step] = (float(torch.cat([a.flatten() for a in after]).norm()),
                              float(torch.cat([(a - b).flatten() for a, b in zip(after, before)]).norm()))
            opt.step()
    scalars = pd.read_parquet(run / "scalars.parquet").dropna(subset=["grad_norm"])
    assert len(scalars) >= 1
    for row in scalars.itertuples():
        total, fresh = expected[int(row.step)]
        assert row.grad_norm == pytest.approx(total, rel=1e-4)
        assert row.fresh_grad_norm == pytest.approx(fresh, rel=1e-4, abs=1e-7)


# --- the columns the recorder writes, and the last step ---------------------------------------

@FAST
@given(taken=st.sets(st.sampled_from(RESERVED), min_size=1, max_size=3), after=st.booleans())
def test_rec_log_refuses_the_reserved_columns_and_names_them(tmp_path_factory, taken, after):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path_factory.mktemp("log") / "run", every=1) as rec:
        x, y = batch(0)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if after:
            opt.step()
        with pytest.raises(UserError) as refused:
            rec.log(loss=loss, **{name: 7.5 for name in taken})
        line = one_line(refused.value)
        assert all(name in line for name in taken)
        if not after:
            opt.step()
    scalars = pd.read_parquet(rec.run_dir / "scalars.parquet")
    assert pd.api.types.is_integer_dtype(scalars["step"]) and list(scalars["step"]) == [0]
    assert scalars["lr"].tolist() == [0.1]


@FAST
@given(steps=st.integers(1, 14), every=st.integers(1, 6), told=st.booleans())
def test_a_recording_logs_its_last_step_as_built_in_runs_do(tmp_path_factory, steps, every, told):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"steps": steps} if told else {}
    with gradrepro.record(model, opt, tmp_path_factory.mktemp("last") / "run", every=every, **options) as rec:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            rec.log(loss=loss)
    scalars = pd.read_parquet(rec.run_dir / "scalars.parquet")
    assert scalars["step"].max() == steps - 1 and np.isfinite(scalars["loss"]).all()
    assert scalars["step"].is_unique and scalars["step"].is_monotonic_increasing
    modules = pd.read_parquet(rec.run_dir / "modules.parquet")
    if told:  # told the length of the loop: the last step's gradients are recorded in full
        assert modules["step"].max() == steps - 1
    assert json.loads((rec.run_dir / "summary.json").read_text())["steps"] == steps


def test_a_healthy_model_says_no_findings(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1) as rec:
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(*rec.findings())
    assert "no findings" in out.getvalue() and out.getvalue().strip()
    assert [f.severity for f in rec.findings()] == ["info"]


def test_in_lightning_the_fresh_gradient_is_the_steps_own(tmp_path):
    """Lightning calls zero_grad inside its closure, after the forward pass: the gradient the
    step left in .grad is not subtracted from the next one."""
    pl = pytest.importorskip("lightning.pytorch")
    from gradrepro.lightning import Record

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, data, index):
            return F.cross_entropy(self.net(data[0]), data[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = batch(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(4, 1), y.repeat(4)), batch_size=8)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Record(tmp_path / "run", every=1)])
    trainer.fit(Tiny(), loader)
    scalars = pd.read_parquet(tmp_path / "run" / "scalars.parquet")
    assert list(scalars["step"]) == [0, 1, 2, 3]
    assert np.allclose(scalars["fresh_grad_norm"], scalars["grad_norm"], rtol=1e-5)
