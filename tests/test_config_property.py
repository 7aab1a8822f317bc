"""Random override strings against the config layer: every command line
either composes and validates (and, under ``-m slow``, runs) or is refused with one clean
line; never a traceback, never another exception type."""

from __future__ import annotations

import os
import string

import pytest
from conftest import compose_config, experiment_names
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from gradrepro.cli import preflight
from gradrepro.errors import UserError

GROUPS = ["experiment", "model", "data", "objective", "optim", "init", "precision", "probe", "scale"]
KEYS = [
    "seed", "device", "threads", "name", "key_scalar", "train.steps", "train.zero_grad",
    "train.grad_clip", "train.freeze", "eval.every", "eval.knn_k", "optim.name", "optim.lr",
    "optim.momentum", "optim.weight_decay", "optim.betas", "optim.schedule", "init.scheme",
    "init.std", "precision.mode", "precision.loss_scale", "probe.every", "probe.activations",
    "probe.act_sample", "probe.tiny_factor", "probe.task_contribution", "data.n_train",
    "data.n_test", "data.batch_size", "data.views", "data.root", "data.image_size",
    "data.channels", "data.num_classes", "model.widths", "model.num_classes", "model.activation",
    "model.batchnorm", "objective.stop_gradient", "objective.dim", "objective.predictor",
    "signature.window", "signature.checks", "paper.note",
    # misspellings and keys that do not exist
    "optim.lrr", "trian.steps", "model.widht", "foo", "train", "optim", "hydra.foo",
]
CHOICES = [*experiment_names(), "mlp", "convnet", "digits", "patterns", "simsiam", "sgd",
           "adam", "kaiming", "fp16", "fp32", "off", "tiny", "nope"]
NUMBERS = ["-1", "0", "1", "2", "3", "0.5", "1e-3", "1e30", "-1e30", "1e400", "nan", "inf",
           "-inf", "4294967296", "99999999999999999999"]
ODD = ["null", "true", "false", "[]", "[1,2]", "[-1]", "[0]", "{}", "{a: 1}", "${nope}",
       "${optim.lr}", "${calc:'1/0'}", "'quoted'", "[1,2", "a,b", "range(0,2)", "''", " ",
       "glob(*)", "\\", "$", "=", "::"]
TEXT = st.text(alphabet=string.ascii_letters + string.digits + "._-+~=,[]{}$:'\"() /\\*",
               max_size=12)
VALUE = st.one_of(st.sampled_from(NUMBERS + ODD + CHOICES), st.integers(-10**6, 10**6).map(str),
                  st.floats(allow_nan=True, allow_infinity=True).map(repr), TEXT)
KEY = st.one_of(st.sampled_from(KEYS + GROUPS), TEXT)
PREFIX = st.sampled_from(["", "", "", "+", "++", "~"])
OVERRIDE = st.one_of(
    st.builds(lambda p, k, v: f"{p}{k}={v}", PREFIX, KEY, VALUE),
    st.builds(lambda p, k: f"{p}{k}", PREFIX, KEY),  # no value at all
    TEXT,
)
ARGV = st.lists(OVERRIDE, min_size=1, max_size=4)
# Mostly well-formed: each key with values of its own kind (edges included), so that many
# configs pass the preflight and run.
_INTS = ["0", "1", "2", "3", "7", "64"]
_FLOATS = ["0.0", "1e-3", "0.5", "0.9", "2.0", "1e30"]
_BOOLS = ["true", "false"]
PLAUSIBLE = {
    **{k: _INTS for k in ("seed", "train.steps", "eval.every", "eval.knn_k", "probe.every",
                          "probe.act_sample", "data.n_train", "data.n_test", "data.batch_size",
                          "data.image_size", "data.channels", "data.num_classes",
                          "model.num_classes", "objective.dim", "signature.window", "threads")},
    **{k: _FLOATS for k in ("optim.lr", "optim.momentum", "optim.weight_decay", "init.std",
                            "train.grad_clip", "probe.tiny_factor", "precision.loss_scale")},
    **{k: _BOOLS for k in ("train.zero_grad", "probe.activations", "probe.task_contribution",
                           "data.views", "model.batchnorm", "objective.stop_gradient",
                           "objective.predictor")},
    "optim.betas": ["[0.9,0.999]", "[0.0,0.5]"], "model.widths": ["[8]", "[1,1]", "[]", "[16,16,16]"],
    "train.freeze": ["[]", "[layers]", "[predictor]", "[encoder]"],
    "model.activation": ["relu", "tanh"], "precision.loss_scale": ["dynamic", "1.0", "1024"],
    "optim.name": ["sgd", "adam", "adamw"], "optim.schedule": ["constant", "cosine"],
    "init.scheme": ["default", "kaiming", "xavier", "normal", "glorot_standard"],
    "precision.mode": ["fp32", "fp16"], "device": ["cpu", "auto"],
    **{g: [c for c in CHOICES if c != "nope"] for g in GROUPS},
}
PLAIN = st.lists(st.sampled_from([f"{k}={v}" for k in sorted(PLAUSIBLE) for v in PLAUSIBLE[k]]),
                 min_size=1, max_size=3)


def check_clean(argv) -> bool:
    """True if the config passed the preflight; False if refused with one clean line.
    Any other outcome (another exception, a multi-line message) fails the test."""
    try:
        preflight.check(argv)
    except UserError as exc:
        message = str(exc)
        assert message.strip(), f"empty message for {argv}"
        assert "\n" not in message, f"multi-line message for {argv}: {message!r}"
        assert "Traceback" not in message
        return False
    return True


_SETTINGS = {"deadline": None, "derandomize": True, "database": None,
             "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}


@settings(max_examples=25, **_SETTINGS)
@given(argv=ARGV)
def test_random_overrides_compose_or_fail_in_one_line(argv):
    check_clean(["scale=tiny", *argv])


# The tiny run's sizes, capped so that a valid random config runs in about a second.
_CAPS = {"train.steps": 3, "data.n_train": 128, "data.n_test": 64, "data.batch_size": 32}


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("GRADREPRO_PROPERTY_EXAMPLES", "300")), **_SETTINGS)
@given(argv=st.one_of(ARGV, PLAIN))
def test_random_overrides_run_or_fail_in_one_line(argv, tmp_path_factory):
    from gradrepro.train import pipeline as runner

    argv = ["scale=tiny", *argv]
    if not check_clean(argv):
        event("refused by the preflight")
        return
    overrides = [a for a in argv if not a.startswith("hydra")]
    cfg = compose_config(overrides)
    for key, cap in _CAPS.items():
        if OmegaConf.select(cfg, key) > cap:
            OmegaConf.update(cfg, key, cap)
    OmegaConf.update(cfg, "threads", 1)
    try:
        summary = runner.run(cfg, tmp_path_factory.mktemp("run"), overrides)
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc).strip()
        event("refused by the runner")
        return
    event(f"ran: {summary['status']}")
    assert summary["status"] in ("completed", "diverged")
