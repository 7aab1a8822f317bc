"""The fp32 shadow of a logged step (gradrepro/measure/shadow_fp32.py): it measures what fp16
carried as zeros on both fp16 paths, writes no .grad, restores buffers, replays the forward's
random draws, and leaves training bit-identical."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from torch import nn

from gradrepro.config.schema import PrecisionConfig
from gradrepro.config.validate import validate
from gradrepro.errors import UserError
from gradrepro.measure.reference_runs import REFERENCE_MARK
from gradrepro.measure.shadow_fp32 import COLUMNS, ShadowFP32
from gradrepro.recipe.precision import Precision
from gradrepro.train.pipeline import run


def run_records(overrides, run_dir):
    with contextlib.redirect_stdout(io.StringIO()):
        run(compose_config(overrides), run_dir, [*overrides, f"{REFERENCE_MARK}=test"])
    return pd.read_parquet(run_dir / "scalars.parquet"), pd.read_parquet(run_dir / "modules.parquet")


@pytest.mark.parametrize("mode", ["fp16_emulated", "fp16", "fp32"])
def test_the_shadow_leaves_training_bit_identical_and_runs_on_logged_steps_only(tmp_path, mode, monkeypatch):
    common = ["experiment=precision_fp16_dynamic", f"precision.mode={mode}", "train.steps=40", "probe.every=5",
              "eval.every=20"]
    s_off, m_off = run_records([*common, "probe.act_grad_reference=false", "signature.checks=[]"], tmp_path / "off")
    compared = []
    real_compare = ShadowFP32.compare
    monkeypatch.setattr(ShadowFP32, "compare", lambda self, *a: compared.append(1) or real_compare(self, *a))
    s_on, m_on = run_records([*common, "probe.act_grad_reference=true"], tmp_path / "on")
    assert len(compared) == m_on["step"].nunique() == 9  # steps 0, 5, ..., 35 and the last, 39
    pd.testing.assert_frame_equal(s_off, s_on)
    assert not set(COLUMNS) & set(m_off.columns) and set(COLUMNS) <= set(m_on.columns)
    pd.testing.assert_frame_equal(m_off, m_on.drop(columns=list(COLUMNS)))


def test_the_shadow_writes_no_grad_keeps_buffers_and_replays_dropout():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                        nn.Linear(32, 10)).train()
    modules = {n: m for n, m in net.named_modules() if list(m.parameters(recurse=False))}
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))

    def objective(net, batch):
        return SimpleNamespace(loss=F.cross_entropy(net(batch[0]).float(), batch[1]))

    for mode in ("fp32", "fp16_emulated", "fp16"):
        precision = Precision(PrecisionConfig(mode=mode, loss_shift=2.0**-18), torch.device("cpu"))
        shadow = ShadowFP32(modules, mode, sample=16)
        shadow.arm()
        with precision.autocast():
            loss = objective(net, (x, y)).loss
        precision.backward(loss)
        shadow.disarm()
        grads = [p.grad.clone() for p in net.parameters()]
        buffers = [b.clone() for b in net.buffers()]
        rng = torch.get_rng_state()
        shadow.compare(objective, net, (x, y), 2.0**-18, 1.0)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
        assert torch.equal(rng, torch.get_rng_state())
        counts = {name: dict(zip(COLUMNS, c.tolist())) for name, c in shadow.counts.items()}
        assert set(counts) == set(modules)
        # The same dropout masks and batch statistics: nothing is zero in fp32 but carried non-zero.
        assert all(c["act_grad_gained"] == 0 for c in counts.values()), counts
        if mode == "fp32":  # fp32 arithmetic is the shadow's: nothing lost
            assert all(c["act_grad_lost"] == 0 for c in counts.values()), counts
        else:
            # At the output layer the gradient comes straight from the fp32 loss, so fp16 loses
            # exactly the values at or below 2^-25 there; upstream, rounding also moves others.
            last = counts["5"]
            assert last["act_grad_lost"] == last["act_grad_small_lost"] == last["act_grad_ref_small"] > 0
            assert all(c["act_grad_lost"] > 0 for c in counts.values()), counts
        net.zero_grad(set_to_none=True)


def test_columns_follow_the_probes_rows_and_unmeasured_modules_are_nan():
    shadow = ShadowFP32({"a": nn.Linear(2, 2)}, "fp32", sample=4)
    shadow.counts = {"a": torch.arange(len(COLUMNS), dtype=torch.float64)}
    cols = shadow.columns(["a", "a", "b"])
    assert list(cols) == list(COLUMNS)
    np.testing.assert_array_equal(cols["act_grad_ref_numel"], [0.0, 0.0, np.nan])


def test_a_check_on_the_shadow_without_it_is_one_line_before_training():
    cfg = compose_config(["experiment=precision_fp16_noscale", "scale=tiny", "probe.act_grad_reference=false"])
    with pytest.raises(UserError, match=r"act_grad_lost.*probe.act_grad_reference=true"):
        validate(cfg)
