"""``rec.log``: numbers only (a tensor of many elements, a string, None, a dict: one clear
error, never a NaN column), and each value on the step it was logged for, a forward pass
inside the call's own arguments included."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import gradrepro
from gradrepro.errors import UserError


def _loop(tmp_path, every: int, log_inside: bool, steps: int = 5) -> pd.DataFrame:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with gradrepro.record(model, optimizer, tmp_path / "run", every=every, live=False) as rec:
        for step in range(steps):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if log_inside:
                rec.log(mark=step, after=F.cross_entropy(model(x), y))
            else:
                rec.log(mark=step)
    return pd.read_parquet(tmp_path / "run" / "scalars.parquet")


@pytest.mark.parametrize("every", [1, 2])
def test_a_forward_pass_inside_the_call_logs_on_the_step_just_taken(tmp_path, every):
    scalars = _loop(tmp_path, every, log_inside=True).dropna(subset=["mark"])
    assert len(scalars) >= 2
    assert (scalars["mark"] == scalars["step"]).all(), scalars[["step", "mark"]]
    assert scalars["after"].notna().all()


def test_values_logged_after_the_step_land_on_it(tmp_path):
    scalars = _loop(tmp_path, 1, log_inside=False).dropna(subset=["mark"])
    assert list(scalars["step"]) == list(scalars["mark"]) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("value,said", [
    (torch.zeros(3), "shape (3,)"), (torch.zeros(2, 2), "shape (2, 2)"), ("0.5", "str"), (None, "NoneType"),
    ({"a": 1.0}, "dict"), ([1.0], "list"), (torch.zeros(1, dtype=torch.complex64), "complex"),
])
def test_what_is_not_one_number_is_one_clear_error(tmp_path, value, said):
    model = torch.nn.Linear(2, 2)
    with gradrepro.record(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "run") as rec:
        with pytest.raises(UserError, match="rec.log") as refused:
            rec.log(value=value)
    assert said in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("value", [1, 0.5, True, np.float32(2.0), np.int64(3), torch.tensor(1.5), torch.ones(1, 1)])
def test_numbers_and_one_element_tensors_are_logged(tmp_path, value):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrepro.record(model, optimizer, tmp_path / "run", every=1, live=False) as rec:
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        rec.log(value=value)
    assert pd.read_parquet(tmp_path / "run" / "scalars.parquet")["value"].iloc[0] == pytest.approx(float(value))


@pytest.mark.parametrize("make", [lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=5),
                                  lambda p: torch.optim.SGD(p, lr=0.1)], ids=["LBFGS", "SGD"])
def test_a_step_driven_by_its_closure_reads_the_gradients_the_closure_made(tmp_path, make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = make(model.parameters())
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    F.cross_entropy(model(x), y).backward()  # the gradient at the parameters the first step starts from
    expected = model[0].weight.grad.norm().item()
    model.zero_grad(set_to_none=True)

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with gradrepro.record(model, optimizer, tmp_path / "run", every=1) as rec:
        for _ in range(3):
            rec.log(value=optimizer.step(closure))
    kinds = {f.kind for f in rec.findings()}
    assert kinds == {"no_findings"}, rec.findings()
    modules = pd.read_parquet(tmp_path / "run" / "modules.parquet")
    first = modules[(modules["step"] == 0) & (modules["module"] == "0") & (modules["param"] == "weight")]
    assert first["grad_norm"].iloc[0] == pytest.approx(expected, rel=1e-5)
    assert (modules["grad_state"] == "finite").all()
