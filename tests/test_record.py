"""gradrepro.record in a user's own training loop: the run folder the built-in runs write
(read by compare), the right gradients with a GradScaler and with gradient accumulation,
nothing read on steps it does not log, findings over the logged steps, bad input as one line."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, run_module
from torch import nn

import gradrepro
from gradrepro.analysis.compare import compare
from gradrepro.diagnose.severity import PERSIST_STEPS
from gradrepro.errors import UserError
from gradrepro.probe.probe import Probe

torch.set_num_threads(1)


def batches(n, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train(model, opt, data, rec=None):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if rec is not None:
            rec.log(loss=loss)
        losses.append(float(loss.detach()))
    return losses


def read(run_dir):
    return (json.loads((run_dir / "summary.json").read_text()), pd.read_parquet(run_dir / "scalars.parquet"),
            pd.read_parquet(run_dir / "modules.parquet"))


def test_record_writes_the_run_folder_and_compare_reads_it(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_dir = tmp_path / "runs" / "mine"
    rec = gradrepro.record(model, opt, run_dir, every=2)
    losses = train(model, opt, batches(7), rec)
    rec.close()
    summary, scalars, modules = read(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 7 and summary["experiment"] == "mine"
    assert not {"checks", "reproduced", "signature"} & set(summary)
    assert list(scalars["step"]) == [0, 2, 4, 6]
    assert np.allclose(scalars["loss"], [losses[s] for s in (0, 2, 4, 6)])
    assert (scalars["lr"] == 0.1).all() and (scalars["loss_scale"] == 1.0).all()
    assert len(modules) == 4 * 4 and set(modules["grad_state"]) == {"finite"}
    assert (run_dir / "signals.png").stat().st_size > 0
    tables, runs, warnings = compare([tmp_path / "runs"])
    assert not warnings and len(runs) == 1
    row = tables["runs"].iloc[0]
    assert row["experiment"] == "mine" and row["status"] == "completed"
    assert row["final_loss"] == scalars["loss"].iloc[-1]


def test_compare_reads_a_recording_beside_a_built_in_run(tmp_path, tiny_runs):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "mine", every=1) as rec:
        train(model, opt, batches(3), rec)
    proc = run_module("gradrepro.compare", str(tiny_runs["zero_grad_baseline"]), str(tmp_path / "mine"),
                      "--table", "runs", "--format", "csv", timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(pd.io.common.StringIO(proc.stdout))
    assert set(table["experiment"]) == {"zero_grad_baseline", "mine"}
    assert "skipped" not in proc.stderr


def test_the_folder_is_written_during_the_loop_with_status_running(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADREPRO_FLUSH_SECONDS", "0")  # write at every logged step
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradrepro.record(model, opt, tmp_path / "run", every=1)
    train(model, opt, batches(3), rec)
    summary, scalars, modules = read(tmp_path / "run")  # as a killed process would leave it
    assert summary["status"] == "running" and list(modules["step"].unique()) == [0, 1, 2]
    tables, runs, _ = compare([tmp_path / "run"])
    assert not runs[0].complete and tables["runs"].iloc[0]["status"] == "incomplete (running)"
    rec.close()
    assert read(tmp_path / "run")[0]["status"] == "completed"


def test_an_exception_in_the_with_block_is_recorded_and_raised(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ZeroDivisionError):
        with gradrepro.record(model, opt, tmp_path / "run", every=1) as rec:
            train(model, opt, batches(2), rec)
            raise ZeroDivisionError("in the loop")
    summary, scalars, _ = read(tmp_path / "run")
    assert summary["status"] == "failed" and "ZeroDivisionError" in summary["error"] and len(scalars) == 2
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # hooks removed


def test_grad_scaler_records_unscaled_gradients_and_the_scale(tmp_path):
    data = batches(4)
    plain, scaled = mlp(), mlp()
    opt_p, opt_s = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(scaled.parameters(), lr=0.1)
    with gradrepro.record(plain, opt_p, tmp_path / "plain", every=1) as rec:
        train(plain, opt_p, data, rec)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradrepro.record(scaled, opt_s, tmp_path / "scaled", every=1, scaler=scaler) as rec:
        for x, y in data:
            opt_s.zero_grad()
            loss = F.cross_entropy(scaled(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt_s)
            scaler.update()
            rec.log(loss=loss)
    _, sc_p, mod_p = read(tmp_path / "plain")
    _, sc_s, mod_s = read(tmp_path / "scaled")
    assert (sc_s["loss_scale"] == 2.0**10).all()
    # A power-of-two scale and its unscale are exact in float32: the same gradients, bit for bit.
    assert np.array_equal(mod_p["grad_norm"], mod_s["grad_norm"]) and np.array_equal(sc_p["loss"], sc_s["loss"])


def test_a_step_the_scaler_skips_is_not_a_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = batches(4)
    data[1] = (data[1][0] * math.inf, data[1][1])  # non-finite gradients: the scaler skips this step
    with gradrepro.record(model, opt, tmp_path / "run", every=1, scaler=scaler):
        for x, y in data:
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    summary, scalars, modules = read(tmp_path / "run")
    assert summary["steps"] == 3 and list(scalars["step"]) == [0, 1, 2]
    assert list(scalars["loss_scale"]) == [2.0**10, 2.0**10, 2.0**9]  # backed off after the skip
    assert set(modules["grad_state"]) == {"finite"}


def test_gradient_accumulation_records_the_summed_gradient_of_each_step(tmp_path):
    recorded, twin = mlp(), mlp()
    opt_r, opt_t = torch.optim.SGD(recorded.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    data, k, expected = batches(12), 3, []
    with gradrepro.record(recorded, opt_r, tmp_path / "run", every=1):
        for start in range(0, len(data), k):
            for model, opt in ((recorded, opt_r), (twin, opt_t)):
                opt.zero_grad()
                for x, y in data[start:start + k]:
                    (F.cross_entropy(model(x), y) / k).backward()
                if model is twin:
                    expected.append(float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in twin.parameters()))))
                opt.step()
    summary, scalars, modules = read(tmp_path / "run")
    assert summary["steps"] == 4 and list(scalars["step"]) == [0, 1, 2, 3]
    assert np.allclose(scalars["grad_norm"], expected, rtol=1e-6)
    assert np.allclose(scalars["grad_norm"], scalars["fresh_grad_norm"])  # zeroed at each step's start


def test_steps_it_does_not_log_read_nothing(tmp_path, monkeypatch):
    calls = {"start": 0, "collect": 0, "after": 0, "float": 0}
    for name, key in (("start", "start"), ("collect", "collect"), ("finish", "after")):
        original = getattr(Probe, name)

        def spy(self, *args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Probe, name, spy)

    class Counted:
        def __float__(self):
            calls["float"] += 1
            return 1.0

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=5) as rec:
        for x, y in batches(12):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            rec.log(during=Counted())  # inside the step
            opt.step()
            rec.log(after=Counted())  # after it
    # steps 0, 5 and 10 only; the last step (11), which the schedule skips, has its two values read at close
    assert calls == {"start": 3, "collect": 3, "after": 3, "float": 8}
    _, scalars, _ = read(tmp_path / "run")
    assert list(scalars["step"]) == [0, 5, 10, 11]  # the last step too, read at close
    assert (scalars["during"] == 1).all() and (scalars["after"] == 1).all()


def test_evaluation_passes_without_gradients_are_not_steps(tmp_path):
    model = mlp()
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, x_val = batches(3), torch.randn(4, 6) + 5.0
    with gradrepro.record(model, opt, tmp_path / "run", every=1):
        for x, y in data:
            with torch.no_grad():
                model(x_val)  # a validation pass before the training step
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    _, _, modules = read(tmp_path / "run")
    assert modules["step"].nunique() == 3
    first = modules[(modules["step"] == 0) & (modules["param"] == "weight")].set_index("module")
    # the activations of the training batch (its first act_sample = 8 examples), not the validation batch's
    expected = float(before[0](data[0][0][:8]).detach().mean())
    assert first.loc["0", "act_mean"] == pytest.approx(expected, rel=1e-5)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.aux = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.enc.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))  # aux is never used


def test_findings_over_the_logged_steps(tmp_path):
    model = Branchy()
    opt = torch.optim.SGD([model.head.weight, model.aux.weight, model.aux.bias], lr=0.1)  # head.bias left out
    steps = PERSIST_STEPS  # an unused branch is a warning once it holds this many logged steps in a row
    with gradrepro.record(model, opt, tmp_path / "run", every=1) as rec:
        train(model, opt, batches(steps))
    found = {(f.kind, f.name): f for f in rec.findings()}
    unused = found[("no_gradient", "aux.weight")]
    assert unused.severity == "warning"
    assert f"every one of the {steps} logged steps" in unused.detail and "find_unused_parameters" in unused.detail
    assert found[("not_in_optimizer", "head.bias")].severity == "error"
    assert found[("not_updated", "head.bias")].severity == "error"
    assert found[("frozen", "enc.weight")].severity == "info"
    assert not {n for k, n in found if k != "frozen"} & {"enc.weight", "head.weight"}
    healthy = mlp()
    opt = torch.optim.SGD(healthy.parameters(), lr=0.1)
    with gradrepro.record(healthy, opt, tmp_path / "healthy", every=1) as rec:
        train(healthy, opt, batches(3))
    assert [(f.kind, f.severity) for f in rec.findings()] == [("no_findings", "info")]
    assert "no findings over 3 logged step(s)" in str(rec.findings()[0])


def test_a_parameter_without_gradient_on_some_steps_is_information(tmp_path):
    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.calls = nn.Linear(6, 3), nn.Linear(6, 3), 0

        def forward(self, x):
            self.calls += 1
            return self.a(x) + (self.b(x) if self.calls % 2 else 0)  # b is used on every other step

    model = Sometimes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1) as rec:
        train(model, opt, batches(4))
    found = {(f.kind, f.name): f for f in rec.findings()}
    assert found[("no_gradient", "b.weight")].severity == "info"
    assert "2 of the 4 logged steps" in found[("no_gradient", "b.weight")].detail
    assert not [f for f in rec.findings() if f.severity != "info"], rec.findings()


def test_sparse_gradients_are_recorded_as_the_dense_gradient_they_stand_for(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))
    twin = copy.deepcopy(model)
    idx, y = torch.randint(0, 3, (16,)), torch.randint(0, 3, (16,))  # rows 3..9 are never looked up
    F.cross_entropy(twin(idx), y).backward()
    expected = float(torch.linalg.vector_norm(twin[0].weight.grad.to_dense()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1):
        opt.zero_grad()
        F.cross_entropy(model(idx), y).backward()
        opt.step()
    _, _, modules = read(tmp_path / "run")
    row = modules[modules["module"] == "0"].iloc[0]
    assert row["grad_state"] == "finite" and row["frac_zero"] == pytest.approx(0.7)
    assert row["grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_complex_weights_are_recorded_by_their_real_and_imaginary_parts(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(6, 4, dtype=torch.cfloat)
    xc = torch.randn(16, 6, dtype=torch.cfloat)
    twin = copy.deepcopy(model)
    twin(xc).abs().pow(2).mean().backward()
    expected = float(torch.linalg.vector_norm(twin.weight.grad))
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, opt, tmp_path / "run", every=1):
        opt.zero_grad()
        model(xc).abs().pow(2).mean().backward()
        opt.step()
    _, _, modules = read(tmp_path / "run")
    row = modules[modules["param"] == "weight"].iloc[0]
    assert row["numel"] == 2 * model.weight.numel()  # one real and one imaginary part an entry
    assert row["grad_norm"] == pytest.approx(expected, rel=1e-6)
    moved = float(torch.linalg.vector_norm(before - model.weight.detach()))
    assert row["update_to_param"] * row["param_norm"] == pytest.approx(moved, rel=1e-5)
    assert row["param_norm"] == pytest.approx(float(torch.linalg.vector_norm(before)), rel=1e-6)


def test_bad_input_is_one_line(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [((model, "adam", tmp_path / "a"), {}, "optimizer must be"),
             ((model, opt, tmp_path / "b"), {"every": 0}, "every=0"),
             ((object(), opt, tmp_path / "c"), {}, "torch.nn.Module"),
             ((model, opt, tmp_path / "file.txt" / "run"), {}, "cannot write")]
    (tmp_path / "file.txt").write_text("not a folder")
    for args, kwargs, words in cases:
        with pytest.raises(UserError) as info:
            gradrepro.record(*args, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value)


def test_importing_gradrepro_stays_light_and_record_is_callable_either_way():
    code = ("import sys, gradrepro; light = 'torch' not in sys.modules; import gradrepro.record; "
            "print(light, callable(gradrepro.record), gradrepro.record.Recorder.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "Recorder"], out.stderr
