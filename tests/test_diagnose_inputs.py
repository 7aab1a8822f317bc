"""Misuse of ``diagnose`` and ``check_derivative`` is one DiagnoseError line, never a raw
error from deep inside: a meta-device model, a closure that takes arguments, options that are
not numbers or not in range (eps=nan, n_entries=0, tiny_factor='big'), an optimizer over
another model. Then generated option
values: each call either works or says what is wrong in one line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradrepro.diagnose import DiagnoseError, check_derivative, diagnose

torch.set_num_threads(1)
X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1] * 4)


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda: F.cross_entropy(model(X), Y)


def one_line_error(call) -> str:
    with pytest.raises(DiagnoseError) as refused:
        call()
    message = str(refused.value)
    assert message.strip() and "\n" not in message
    return message


def test_a_meta_device_model_is_refused():
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    message = one_line_error(lambda: diagnose(model, optimizer, lambda: model(X).sum()))
    assert "meta device" in message and "to_empty" in message
    one_line_error(lambda: check_derivative(lambda: model(X).sum(), model.weight))


def test_a_closure_that_takes_arguments_is_refused():
    model, optimizer, _ = setup()

    def needs_batch(x, y):
        return F.cross_entropy(model(x), y)

    message = one_line_error(lambda: diagnose(model, optimizer, needs_batch))
    assert "no arguments" in message and "x, y" in message
    one_line_error(lambda: check_derivative(needs_batch, model[0].weight))
    diagnose(model, optimizer, lambda x=X, y=Y: F.cross_entropy(model(x), y))  # defaults are fine


def test_an_optimizer_over_another_model_is_one_line():
    model, _, closure = setup()
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    before = [p.detach().clone() for p in model.parameters()]
    for optimizer in (torch.optim.SGD(other.parameters(), lr=0.1),  # another model's
                      torch.optim.Adam([p.detach().clone().requires_grad_() for p in model.parameters()])):  # copies
        message = one_line_error(lambda opt=optimizer: diagnose(model, opt, closure))
        assert "none is a parameter of this Sequential" in message and "model.parameters()" in message
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # refused before anything ran
    assert all(p.grad is None for p in model.parameters())
    # One tensor in common is a partial mismatch: a report, not a refusal.
    partial = torch.optim.SGD([*other.parameters(), model[0].weight], lr=0.1)
    assert not diagnose(model, partial, closure).ok


@pytest.mark.parametrize("options,fragment", [
    ({"tiny_factor": "big"}, "tiny_factor must be a number"),
    ({"tiny_factor": math.nan}, "tiny_factor=nan"),
    ({"tiny_factor": 0}, "tiny_factor=0"),
    ({"stale_factor": None}, "stale_factor must be a number"),
    ({"fp16_fraction": 2.0}, "fp16_fraction=2.0"),
    ({"rtol": -1}, "rtol=-1"),
    ({"step": "yes"}, "step must be True or False"),
])
def test_diagnose_options_out_of_range_are_one_line(options, fragment):
    model, optimizer, closure = setup()
    assert fragment in one_line_error(lambda: diagnose(model, optimizer, closure, **options))


@pytest.mark.parametrize("options,fragment", [
    ({"eps": "small"}, "eps must be a number"),
    ({"eps": math.nan}, "eps=nan"),
    ({"eps": 0.0}, "eps=0.0"),
    ({"eps": math.inf}, "eps=inf"),
    ({"n_entries": 0}, "n_entries=0"),
    ({"n_entries": 2.5}, "n_entries=2.5"),
    ({"seed": -1}, "seed=-1"),
    ({"model": "net"}, "model must be"),
    ({"index": []}, "names no entry"),
    ({"index": True}, "names no entry"),
])
def test_check_derivative_options_out_of_range_are_one_line(options, fragment):
    model, _, closure = setup()
    assert fragment in one_line_error(lambda: check_derivative(closure, model[0].weight, **options))


ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=5), st.lists(st.integers(), max_size=2))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(option=st.sampled_from(["tiny_factor", "stale_factor", "fp16_fraction", "rtol", "step", "probe_paths"]),
       value=ANY)
def test_generated_diagnose_options_work_or_fail_in_one_line(option, value):
    model, optimizer, closure = setup()
    try:
        diagnose(model, optimizer, closure, **{option: value})
    except DiagnoseError as exc:
        assert "\n" not in str(exc) and option in str(exc)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(option=st.sampled_from(["eps", "n_entries", "seed", "float64", "index"]), value=ANY)
def test_generated_derivative_options_work_or_fail_in_one_line(option, value):
    model, _, closure = setup()
    try:
        error = check_derivative(closure, model[0].weight, **{option: value})
    except DiagnoseError as exc:
        assert "\n" not in str(exc)
        return
    assert math.isfinite(error)
