"""Every numeric key of every experiment's composed config (``--cfg job``), set to NaN, inf, 0,
a negative or a huge value on the command line, is either accepted by the pre-run checks (the
config composes, validates, and its model, objective and optimizer build) or refused with one
line naming the key: never a traceback, never a process started with it."""

from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import pytest
from conftest import composed, experiment_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from gradrepro.cli import preflight
from gradrepro.config.numbers import is_signed, numeric_leaves
from gradrepro.errors import UserError

# The values a careless or hostile user types; floats and whole numbers of every sign and size.
EDGE_VALUES = ("nan", "inf", "-inf", "0", "0.0", "-1", "-0.5", "1e-300", "1e300", "1e-9", "9" * 30,
               "-" + "9" * 30)
# Each experiment's keys at scale=tiny, the first experiment that has each key.
FIXED = ("scale=tiny",)


def dotted(key: str) -> str:
    """``signature.checks[0].threshold`` as an override names it: ``signature.checks.0.threshold``."""
    return key.replace("[", ".").replace("]", "")


@functools.lru_cache(maxsize=None)
def numeric_keys() -> Tuple[Tuple[str, str], ...]:
    """``(experiment, key)`` for every numeric key of any experiment's config, once each."""
    seen: Dict[str, str] = {}
    for name in experiment_names():
        plain = OmegaConf.to_container(composed(name, "scale=tiny"), resolve=True)
        for key, _ in numeric_leaves({k: v for k, v in plain.items() if k != "paper"}):
            seen.setdefault(key, name)
    return tuple((name, key) for key, name in sorted(seen.items()))


def outcome(experiment: str, key: str, value: str) -> str:
    """'accepted', or the one line the pre-run checks refused it with."""
    argv = [f"experiment={experiment}", *FIXED, f"{dotted(key)}={value}"]
    try:
        checked = preflight.check(argv)
    except UserError as exc:
        line = str(exc)
        assert line.strip() and "\n" not in line, f"{argv}: not one line: {line!r}"
        assert "$VALUE" not in line and "$KEY" not in line, f"{argv}: placeholders left: {line!r}"
        return line
    assert checked.cfg is not None
    return "accepted"


def test_every_experiment_has_numeric_keys_to_check():
    keys = [key for _, key in numeric_keys()]
    assert {"distributed.timeout_s", "optim.lr", "signature.checks[0].threshold", "train.steps"} <= set(keys)


@pytest.mark.parametrize("override,said", [
    ("distributed.timeout_s=1e300", "distributed.timeout_s"), ("distributed.timeout_s=1e-9", "distributed.timeout_s"),
    ("signature.checks.0.threshold=nan", "signature.checks[0].threshold"), ("optim.lr=inf", "optim.lr"),
    ("data.n_train=-5", "data.n_train"), ("init.std=1e300", "init.std"),
])
def test_the_values_that_reached_a_process_are_refused_with_one_line(override, said):
    key, _, value = override.partition("=")
    line = outcome("simsiam_nostopgrad", key, value)
    assert line != "accepted" and said in line and value.lstrip("-")[:3] in line.replace("e+", "e")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_numeric_key_at_an_edge_is_accepted_or_refused_in_one_line(data):
    experiment, key = data.draw(st.sampled_from(numeric_keys()), label="key")
    value = data.draw(st.sampled_from(EDGE_VALUES), label="value")
    line = outcome(experiment, key, value)
    assert not (line == "accepted" and must_refuse(key, value)), f"{key}={value} was accepted"


def must_refuse(key: str, value: str) -> bool:
    """What the pre-run checks promise to refuse: NaN and inf on every key, any negative value
    on a key where nothing negative means anything. A signed key (a check's threshold, its
    parameters) takes any finite number, -1e30 included: it is compared in float64."""
    return value in ("nan", "inf", "-inf") or (value.startswith("-") and float(value) != 0 and not is_signed(key))


@pytest.mark.slow
def test_every_numeric_key_at_every_edge_is_accepted_or_refused_in_one_line():
    wrongly_accepted: List[str] = []
    for experiment, key in numeric_keys():
        for value in EDGE_VALUES:
            if outcome(experiment, key, value) == "accepted" and must_refuse(key, value):
                wrongly_accepted.append(f"{experiment}: {key}={value}")
    assert not wrongly_accepted, wrongly_accepted


def test_a_huge_accumulation_is_refused_at_once_with_a_divisor_of_the_batch():
    """The suggestion names the largest divisor of the batch below the value asked for: it is
    searched among the batch's divisors, not among every number up to a value like 1e30."""
    line = outcome("accum_full_batch", "train.accumulate", "9" * 30)
    assert "train.accumulate" in line and "must divide data.batch_size" in line
