"""Every registered thing is tested by its registry (the timm ``test_model_backward`` habit): a
metric, a model, an objective, a data choice or a measurement is covered the day it is
registered, with no test to write by hand. Experiment lists come from the configs."""

from __future__ import annotations

import functools
import inspect
import math

import pandas as pd
import pytest
import torch
from conftest import compose_config, composed, experiment_names
from omegaconf import OmegaConf

from gradrepro.config.compose import group_options_recursive
from gradrepro.errors import UserError
from gradrepro.measure import MEASUREMENTS
from gradrepro.models.missing_grad import CAUSES
from gradrepro.probe import Probe
from gradrepro.probe.config import ProbeConfig
from gradrepro.recipe.build import build_training
from gradrepro.records.run import RunRecords
from gradrepro.signature import METRICS

# Parameters for the metrics no experiment uses yet (an experiment's own params are taken from
# its config): a metric registered with required parameters and no example fails the test below.
UNUSED_METRIC_PARAMS = {
    "layer_ratio": {"numerator": "linear[-1]", "denominator": "linear[0]", "column": "grad_norm"},
    "max_deviation": {"column": "loss", "target": 0.0},
    "reference_stat": {"module": "linear[0]", "column": "grad_std"},
    "times_below_reference": {"module": "linear[0]", "column": "grad_std"},
}
# Check-level keys that evaluate() handles around the metric (not the metric's own parameters).
CHECK_LEVEL = ("transform", "relative_to", "how", "window")


@functools.lru_cache(maxsize=None)
def composed_checks() -> tuple:
    """(experiment, check) for every check of every experiment config, resolved."""
    out = []
    for name in experiment_names():
        for check in OmegaConf.to_container(composed(name, "scale=tiny").signature.checks, resolve=True):
            out.append((name, check))
    return tuple(out)


def metric_examples() -> dict:
    examples = {name: [dict(params)] for name, params in UNUSED_METRIC_PARAMS.items()}
    for name, fn in METRICS.items():  # a metric without required parameters runs as it is
        required = [p for p in list(inspect.signature(fn).parameters.values())[2:]
                    if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not required:
            examples.setdefault(name, []).append({})
    for _, check in composed_checks():
        if check["metric"] in METRICS:
            params = {k: v for k, v in (check.get("params") or {}).items() if k not in CHECK_LEVEL}
            if params not in examples.setdefault(check["metric"], []):
                examples[check["metric"]].append(params)
    return examples


def test_every_metric_has_example_parameters():
    examples = metric_examples()
    assert set(METRICS) <= set(examples), f"no example for {sorted(set(METRICS) - set(examples))}"


@functools.lru_cache(maxsize=None)
def synthetic_records() -> RunRecords:
    """Five logged steps of a real probe on a small MLP (every column the probe records), the
    scalars a run records, constants of an init reference, and itself as a reference run."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = Probe(net, ProbeConfig(every=1, act_grad_hist=True, per_example=True), total_steps=5)
    blocks, rows = [], []
    for step in range(5):
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        opt.zero_grad()
        with probe.step(step, lr=0.1) as p:
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            p.collect()
            opt.step()
        blocks.append(pd.DataFrame(p.columns))
        rows.append({"step": step, "loss": float(loss.detach()), "lr": 0.1, "train_acc": 0.3 + 0.1 * step,
                     "test_acc": 0.3 + 0.1 * step, "knn_acc": 0.5, "z_std": 0.1, "grad_norm": 1.0 + step,
                     "fresh_grad_norm": 1.0, "step_vs_fresh": 1.0, "loss_scale": 1.0})
    modules = pd.concat(blocks, ignore_index=True)
    weights = modules[(modules["step"] == 0) & (modules["param"] == "weight")]
    constants = {"n_test": 100.0, "reference/loss": 2.0, "test_acc_init": 0.3}
    for module in weights["module"]:
        constants.update({f"init/{module}.weight/std": 0.5, f"reference/{module}.weight/init_std": 1.0,
                          f"reference/{module}.weight/grad_std": 1e-3, f"reference/{module}.weight/act_grad_std": 1e-3})
    own = RunRecords(pd.DataFrame(rows), modules, constants)
    references = {name: own for name in ("control", "fp32", "lookalike", "baseline", "reference")}
    return RunRecords(own.scalars, own.modules, own.constants, references)


EMPTY = RunRecords(pd.DataFrame({"step": pd.Series([], dtype="int64")}), pd.DataFrame(), {}, {})


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_gives_a_number_or_nan_never_an_exception(name):
    for params in metric_examples()[name]:
        for records in (EMPTY, synthetic_records()):
            value = METRICS[name](records, 3, **params)
            assert isinstance(value, float), (name, params, value)


def test_every_experiment_check_reads_a_registered_metric_or_a_recorded_name():
    from gradrepro.config.validate import produced_names

    for name in experiment_names():
        cfg = composed(name, "scale=tiny")
        produced = produced_names(cfg)
        assert produced, name  # validate() (run by every test that runs one) checks each name


# --- models x objectives: every trainable parameter gets a gradient --------------------------

MODEL_CHOICES = sorted(group_options_recursive("model"))
OBJECTIVE_CHOICES = sorted(group_options_recursive("objective"))
PAIRS = [(m, o) for m in MODEL_CHOICES for o in OBJECTIVE_CHOICES]


def _overrides(model: str, objective: str) -> list:
    data = "patterns" if objective == "simsiam" else "digits"
    out = [f"model={model}", f"objective={objective}", f"data={data}", "scale=tiny", "device=cpu", "threads=1"]
    if objective == "simsiam":
        out += ["data.views=true"]  # SimSiam's two augmented views of each image
    if model in ("plainnet",):
        out += ["model.depth=4", "model.width=4", "model.fc_widths=[8]"]
    if model == "vggb_convs":
        out += ["model.widths=[4,4]"]
    if model == "resnet18_cifar":
        out += ["data.n_train=64", "data.batch_size=8"]
    return out


@pytest.mark.parametrize("model,objective", PAIRS)
def test_every_model_and_objective_give_every_trainable_parameter_a_gradient(model, objective):
    causes = CAUSES if model == "missing_grad" else [None]
    for cause in causes:
        overrides = _overrides(model, objective) + ([f"model.cause={cause}", "model.repaired=true"] if cause else [])
        cfg = compose_config(overrides)
        try:
            t = build_training(cfg, torch.device("cpu"))
        except UserError as exc:  # a pair that cannot go together is refused in one line, naming both
            assert "\n" not in str(exc) and (model in str(exc) or objective in str(exc)), str(exc)
            return
        if t.device_mismatch is not None:
            pytest.fail(f"{model} x {objective}: {t.device_mismatch}")
        batch = t.data.sample(torch.Generator().manual_seed(0))
        t.objective(t.net, batch).loss.backward()
        missing = [n for n, p in t.net.named_parameters()
                   if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
        # The repaired missing_grad cases exist to have every gradient; eval_mode's repair and
        # the others are held to it too.
        assert not missing, f"{model} x {objective} (cause {cause}): no finite gradient for {missing}"


@pytest.mark.parametrize("data", sorted(group_options_recursive("data")))
def test_every_data_choice_builds_or_says_why_in_one_line(data):
    cfg = compose_config([f"data={data}", "scale=tiny", "device=cpu"])
    try:
        t = build_training(cfg, torch.device("cpu"))
    except UserError as exc:  # cifar10 without a local folder: never downloaded
        assert data == "cifar10" and "\n" not in str(exc), str(exc)
        return
    batch = t.data.sample(torch.Generator().manual_seed(0))
    assert batch.x.shape[1:] == (cfg.data.channels, cfg.data.image_size, cfg.data.image_size)
    assert torch.isfinite(batch.x).all() and len(batch.y) == cfg.data.batch_size


# --- measurements ----------------------------------------------------------------------------

def test_every_measurement_declares_its_switch_and_what_it_records():
    for name, cls in MEASUREMENTS.items():
        assert cls.name == name and cls.switch
        # Reference runs record whole run folders (references/NAME), read as records, not names.
        assert cls.constants or cls.columns or name == "reference_runs", name
    assert {"init_reference", "mode_pass", "frozen_audit", "shadow_fp32", "task_contribution",
            "reference_runs"} <= set(MEASUREMENTS)


def test_every_measurement_is_switched_on_by_some_experiment_or_said_to_be_default():
    """A measurement nothing switches on is dead code; the task contribution is on by default."""
    used = set()
    for name in experiment_names():
        used |= {n for n, cls in MEASUREMENTS.items() if cls.enabled(composed(name, "scale=tiny"))}
    assert used == set(MEASUREMENTS), sorted(set(MEASUREMENTS) - used)


def test_a_metric_reading_a_switched_off_measurement_names_the_switch():
    from gradrepro.config.validate import validate

    cfg = compose_config(["experiment=depth30_std001", "scale=tiny", "init.reference=null"])
    with pytest.raises(UserError, match="init.reference=SCHEME"):
        validate(cfg)
    cfg = compose_config(["experiment=precision_fp16_scale8", "scale=tiny", "probe.act_grad_reference=false"])
    with pytest.raises(UserError, match="probe.act_grad_reference=true"):
        validate(cfg)


def test_nan_is_the_answer_for_records_without_the_layer():
    value = METRICS["layer_stat"](EMPTY, 3, module="conv[0]", column="grad_std")
    assert math.isnan(value)
