"""Values that would change the experiment without a word are refused before training, in
one line naming the key: module names that match no module (``train.freeze``,
``train.eval_modules``), a list of configs for one group (``experiment=[a,b]``), an internal
``*_schema`` choice, a model size below 1, a loss shift beyond float32, a run name that is a
path or an interpolation. Composed once, changed in memory: in-process and fast."""

from __future__ import annotations

import copy

import pytest
from conftest import CONFIGS, assert_clean_error, compose_config, run_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict

from gradrepro.cli.override_checks import check_choice_names
from gradrepro.config.schema import SCHEMA_SUFFIX
from gradrepro.config.validate import validate
from gradrepro.data import DATA
from gradrepro.errors import UserError
from gradrepro.models import MODELS
from gradrepro.objectives import OBJECTIVES
from gradrepro.recipe.build import build_untrained

FAST = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_base = {}


def base(experiment: str = "bn_frozen_eval_mode"):
    if experiment not in _base:
        _base[experiment] = compose_config([f"experiment={experiment}", "scale=tiny"])
    return copy.deepcopy(_base[experiment])


def with_value(cfg, key: str, value):
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def refused(fn, *fragments: str) -> str:
    with pytest.raises(UserError) as caught:
        fn()
    line = str(caught.value)
    assert "\n" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def module_names(cfg) -> set:
    net = build_untrained(cfg).net
    return {n for n, _ in net.named_modules() if n} | {n for n, _ in net.named_parameters()}


@FAST
@given(key=st.sampled_from(["train.freeze", "train.eval_modules"]),
       name=st.from_regex(r"[a-z][a-z0-9_.]{0,15}", fullmatch=True))
def test_module_names_that_match_no_module_are_refused_naming_the_valid_ones(key, name):
    cfg = base()
    valid = module_names(cfg)
    cfg = with_value(cfg, key, [name])
    if name in valid:
        build_untrained(cfg)
        return
    refused(lambda: build_untrained(cfg), key, repr(name), "layers.0")  # the model's modules listed


def test_the_module_names_an_experiment_uses_are_accepted():
    build_untrained(base())  # freezes and holds layers.2 and layers.5


@pytest.mark.parametrize("group", ["experiment", "model", "optim"])
def test_a_list_of_configs_for_one_group_is_refused(group):
    options = sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))[:2]
    line = refused(lambda: check_choice_names([f"{group}=[{','.join(options)}]"], CONFIGS), group, "-m")
    assert ",".join(options) in line


@pytest.mark.parametrize("group,name", [(g, n) for g, table in (("model", MODELS), ("data", DATA),
                                                                ("objective", OBJECTIVES)) for n in table])
def test_an_internal_schema_is_not_a_choice(group, name):
    refused(lambda: check_choice_names([f"{group}={name}{SCHEMA_SUFFIX}"], CONFIGS), f"{name}{SCHEMA_SUFFIX}",
            "valid choices")


@FAST
@given(size=st.integers(-5, 0), where=st.sampled_from(["model.widths", "objective.dim", "objective.pred_dim",
                                                         "data.image_size"]))
def test_a_size_below_one_is_refused(size, where):
    experiment = "simsiam_baseline" if where.startswith("objective") else "bn_none"
    cfg = base(experiment)
    value = [size, 4] if where == "model.widths" and OmegaConf.select(cfg, where) is not None else size
    cfg = with_value(cfg, where, value)
    refused(lambda: validate(cfg), where.split(".")[0], str(size))


def test_a_classifier_of_zero_classes_is_a_feature_extractor_not_a_zero_width():
    validate(base("simsiam_baseline"))  # its backbone has num_classes: 0


@FAST
@given(power=st.integers(128, 1023))
def test_a_loss_shift_beyond_float32_is_refused(power):
    cfg = with_value(base(), "precision.loss_shift", 2.0 ** power)
    refused(lambda: validate(cfg), "precision.loss_shift", "float32")


@FAST
@given(name=st.text(min_size=1, max_size=20).filter(lambda s: "/" in s or "\\" in s or "${" in s)
       | st.builds(lambda a, b: f"{a}/{b}", st.from_regex(r"[a-z]{1,6}", fullmatch=True),
                   st.from_regex(r"[a-z]{1,6}", fullmatch=True)))
def test_a_name_with_a_path_separator_or_interpolation_is_refused(name):
    cfg = base()
    with open_dict(cfg):
        cfg.name = name
    refused(lambda: validate(cfg), "name=")


@FAST
@given(name=st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,30}", fullmatch=True).filter(lambda s: s not in (".", "..")))
def test_a_plain_name_is_accepted(name):
    cfg = base()
    with open_dict(cfg):
        cfg.name = name
    validate(cfg)


def test_the_command_line_refuses_an_experiment_list_in_one_line():
    proc = run_module("gradrepro", "experiment=[bn_none,bn_speedup]", "scale=tiny")
    assert_clean_error(proc.returncode, proc.stderr, "experiment", "-m experiment=bn_none,bn_speedup")


@pytest.mark.parametrize("sweep", ["seed=0,0", "threads=1,2,1"])
def test_a_sweep_that_lists_a_value_twice_is_refused_before_any_folder(tmp_path, sweep):
    """Two jobs of one sweep with the same overrides would write one folder (the second
    replacing the first's .hydra/ before its run is refused): refused before Hydra starts."""
    proc = run_module("gradrepro", "-m", "experiment=bn_none", "scale=tiny", sweep,
                      f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert_clean_error(proc.returncode, proc.stderr, "more than once", sweep)
    assert not (tmp_path / "sweep").exists()
