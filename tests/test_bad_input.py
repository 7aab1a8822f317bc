"""Bad config input: one line that names the problem (and the valid choices), exit code 2,
no traceback. Each case runs the CLI's own entry code in-process (fast);
a representative subset also runs as a subprocess of the real CLI, and the whole battery
does under ``-m slow``.

To cover another entry point, add its cases to a list like BAD_INPUTS and check them with
``conftest.assert_clean_error`` on ``conftest.run_module("gradrepro.NAME", ...)``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, assert_clean_error, experiment_names, run_module

from gradrepro import cli
from gradrepro.cli import preflight

# Experiment files with mistakes, put on the search path (never into configs/).
_BAD_EXPERIMENTS = {
    "typo_key": "optim:\n  lrr: 0.1\n",
    "typo_nested": "defaults:\n  - override /model: convnet\n  - _self_\nmodel:\n  widht: 8\n",
    "typo_top": "trian:\n  steps: 5\n",
    "wrong_type": "train:\n  steps: many\n",
    "negative_steps": "train:\n  steps: -5\n",
    "bad_group": "defaults:\n  - override /model: transformer\n  - _self_\n",
    "bad_parent": "defaults:\n  - simsiam_basline\n  - _self_\n",
}
GROUPS = ("model", "data", "objective", "optim", "init", "precision", "probe", "scale")

# (command line, fragments the one error line must contain). {extra}, {copy}, {blocker},
# {cifar_empty}, {tmp} are folders the `paths` fixture makes.
BAD_INPUTS = [
    # unknown experiment or group choice: the valid choices are listed
    (["experiment=nope"], ["unknown experiment 'nope'", "valid choices", *experiment_names()]),
    (["experiment=simsiam_basline"], ["did you mean 'simsiam_baseline'"]),
    *[([f"{g}=nope"], [f"unknown {g} 'nope'", "valid choices"]) for g in GROUPS],
    (["model=MLP"], ["unknown model 'MLP'", "mlp"]),
    # misspelt keys, on the command line and inside experiment files
    (["optim.lrr=0.1"], ["unknown config key 'optim.lrr'", "did you mean 'lr'", "valid keys under optim"]),
    (["trian.steps=5"], ["unknown config key 'trian'", "did you mean 'train'"]),
    (["model.widht=8"], ["'model.widht'", "widths"]),
    (["experiment=simsiam_baseline", "objective.stop_gradeint=false"], ["stop_gradient"]),
    (["+optim.lrr=0.1"], ["unknown config key 'optim.lrr'", "added with '+'", "lr"]),
    (["+foo=1"], ["unknown config key 'foo'", "valid keys"]),
    (["+model.foo=1"], ["unknown config key 'model.foo'"]),
    (["hydra.foo=1"], ["unknown config key 'hydra.foo'"]),
    (["--config-dir", "{extra}", "experiment=typo_key"],
     ["unknown config key 'optim.lrr'", "experiment/typo_key", "did you mean 'lr'"]),
    (["hydra.searchpath=[file://{extra}]", "experiment=typo_key"], ["'optim.lrr'", "experiment/typo_key"]),
    (["--config-dir", "{extra}", "experiment=typo_nested"], ["'model.widht'", "experiment/typo_nested", "channels"]),
    (["--config-dir", "{extra}", "experiment=typo_top"], ["'trian'", "valid keys"]),
    (["--config-path", "{copy}", "experiment=typo_copy"], ["'optim.lrr'", "experiment/typo_copy"]),
    (["--config-dir", "{extra}", "experiment=bad_group"], ["transformer", "mlp"]),
    (["--config-dir", "{extra}", "experiment=bad_parent"], ["simsiam_basline"]),
    # wrong type
    (["train.steps=abc"], ["train.steps", "abc"]),
    (["optim.lr=fast"], ["optim.lr", "fast"]),
    (["seed=1.5"], ["seed", "1.5"]),
    (["probe.activations=maybe"], ["probe.activations"]),
    (["optim.betas=0.9"], ["optim.betas"]),
    (["train.freeze=5"], ["train.freeze"]),
    (["--config-dir", "{extra}", "experiment=wrong_type"], ["train.steps", "many"]),
    # out of range
    (["train.steps=-1"], ["train.steps=-1", ">= 0"]),
    (["--config-dir", "{extra}", "experiment=negative_steps"], ["train.steps=-5"]),
    (["optim.lr=0"], ["optim.lr", "> 0"]),
    (["optim.lr=-0.1"], ["optim.lr"]),
    (["optim.lr=nan"], ["optim.lr=nan"]),
    (["optim.lr=inf"], ["optim.lr=inf"]),
    (["experiment=simsiam_baseline", "optim.lr=0"], ["optim.lr", "> 0"]),
    (["probe.every=0"], ["probe.every=0", "> 0"]),
    (["probe.every=-3"], ["probe.every"]),
    (["eval.every=-1"], ["eval.every"]),
    (["eval.knn_k=0"], ["eval.knn_k"]),
    (["threads=0"], ["threads"]),
    (["data.batch_size=0"], ["data.batch_size"]),
    (["data.n_train=-5"], ["data.n_train"]),
    (["seed=-1"], ["seed=-1"]),
    (["seed=4294967296"], ["seed"]),
    (["optim.momentum=-0.5"], ["optim.momentum"]),
    (["optim.weight_decay=-1"], ["optim.weight_decay"]),
    (["optim=adam", "optim.betas=[0.9,1.5]"], ["optim.betas[1]"]),
    (["optim.betas=[0.9]"], ["optim.betas"]),
    (["train.grad_clip=-1"], ["train.grad_clip"]),
    (["train.clip_order=never"], ["train.clip_order='never'", "after_unscale", "before_unscale"]),
    (["train.clip_norm_from=rank0"], ["train.clip_norm_from='rank0'", "full_tensor", "local_shard"]),
    (["distributed.processes=0"], ["distributed.processes=0", "1 or more"]),
    (["distributed.processes=100000"], ["distributed.processes=100000", "choose 1 to"]),
    (["experiment=shard_norm_local", "data.batch_size=127"],
     ["data.batch_size=127", "multiple of distributed.processes=2"]),
    (["experiment=clip_before_unscale", "distributed.processes=2"], ["references", "single-process runs only"]),
    (["init=normal", "init.std=-0.1"], ["init.std"]),
    (["precision.loss_scale=0"], ["precision.loss_scale"]),
    (["precision.loss_scale=abc"], ["precision.loss_scale", "dynamic"]),
    (["signature.window=0"], ["signature.window"]),
    (["optim.name=lbfgs"], ["optim.name", "sgd", "adam"]),
    (["optim.schedule=linear"], ["optim.schedule", "cosine"]),
    (["init.scheme=he"], ["init.scheme", "kaiming"]),
    (["precision.mode=int8"], ["precision.mode", "fp16", "bf16"]),
    (["device=tpu"], ["device", "cpu", "cuda"]),
    (["model.widths=[-1]"], ["model.widths[0]=-1", ">= 1"]),  # refused by the size check, before building
    (["model.activation=gelu"], ["model.activation='gelu'"]),
    (["~model"], ["model must be set", "mlp"]),
    # data that is not there
    (["data=cifar10", "data.root=/nonexistent/cifar"], ["data.root", "does not hold CIFAR-10", "data=digits"]),
    (["data=cifar10", "data.root={cifar_empty}"], ["does not hold CIFAR-10", "data_batch_1"]),
    (["data=cifar10", "data.root={blocker}"], ["does not hold CIFAR-10"]),
    # interpolations and syntax
    (["optim.lr=${{nope}}"], ["nope"]),
    (["optim.lr=${{calc:'1/0'}}"], ["division by zero"]),
    (["train.steps=[1,2"], ["could not parse"]),
    (["train.steps"], ["could not parse", "train.steps"]),
    (["--config-name", "nope"], ["nope"]),
    (["--config-path", "/nonexistent/configs"], ["not a folder"]),
    # sweeps: every value is checked; a sweep without -m is not silently ignored
    (["-m", "train.steps=-1,5"], ["train.steps=-1"]),
    (["-m", "train.steps=5,-1"], ["train.steps=-1"]),
    (["-m", "experiment=simsiam_baseline,nope"], ["unknown experiment 'nope'"]),
    (["-m", "optim.lrr=0.1,0.2"], ["'optim.lrr'"]),
    (["-m", "experiment=glob(simsiam_*)", "probe.every=0"], ["probe.every"]),
    (["-m", "seed=range(0,3)", "optim.lr=0"], ["optim.lr"]),
    (["train.steps=1,5"], ["needs -m"]),
    # an output folder that cannot be made, checked before anything runs
    (["hydra.run.dir={blocker}/run"], ["hydra.run.dir", "not a folder"]),
    (["-m", "hydra.sweep.dir={blocker}/sweep", "seed=0,1"], ["hydra.sweep.dir", "not a folder"]),
]
if not torch.cuda.is_available():
    BAD_INPUTS.append((["device=cuda"], ["device=cuda", "no CUDA GPU", "device=cpu"]))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_input")
    extra = root / "extra"
    (extra / "experiment").mkdir(parents=True)
    for name, body in _BAD_EXPERIMENTS.items():
        head = "# @package _global_\n"
        if not body.startswith("defaults"):
            head += "defaults:\n  - simsiam_baseline\n  - _self_\n"
        (extra / "experiment" / f"{name}.yaml").write_text(head + body)
    copy = root / "configs_copy"
    shutil.copytree(CONFIGS, copy)
    (copy / "experiment" / "typo_copy.yaml").write_text(
        "# @package _global_\ndefaults:\n  - simsiam_baseline\n  - _self_\noptim:\n  lrr: 1\n")
    blocker = root / "a_file"
    blocker.write_text("not a folder\n")
    cifar_empty = root / "cifar_empty"
    (cifar_empty / "cifar-10-batches-py").mkdir(parents=True)
    return {"extra": extra, "copy": copy, "blocker": blocker, "cifar_empty": cifar_empty,
            "tmp": root}


def _argv(args, paths: dict, run_dir: Path) -> list:
    argv = [a.format(**paths) for a in args]
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        argv.append(f"hydra.run.dir={run_dir}")
    return argv


def _id(case) -> str:
    return " ".join(case[0])[:60]


def _never_reached() -> None:
    raise AssertionError("bad input reached Hydra's main (and so the runner)")


@pytest.mark.parametrize("args,fragments", BAD_INPUTS, ids=[_id(c) for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(args, fragments, paths, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli, "hydra_app", _never_reached)
    with pytest.raises(SystemExit) as stop:
        cli.main(_argv(args, paths, tmp_path / "run"))
    err = capsys.readouterr().err
    line = assert_clean_error(stop.value.code, err, *fragments)
    assert line.startswith("gradrepro: error: ")
    assert not (tmp_path / "run").exists(), "a bad config must not create the run folder"


# The real CLI as a subprocess: a few kinds of mistake in the default run (each costs a
# Python start with torch), every case of the battery under -m slow.
_SUBPROCESS = [
    (["--config-dir", "{extra}", "experiment=typo_nested"], ["'model.widht'", "experiment/typo_nested"]),
    (["-m", "train.steps=5,-1"], ["train.steps=-1"]),
    (["hydra.run.dir={blocker}/run"], ["not a folder"]),
]


def _cli_case(args, fragments, paths, tmp_path) -> None:
    argv = _argv(args, paths, tmp_path / "run")
    if "-m" in argv and not any(a.startswith("hydra.sweep.dir=") for a in argv):
        argv.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    proc = run_module("gradrepro", *argv, timeout=120)
    assert_clean_error(proc.returncode, proc.stderr, *fragments)
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("args,fragments", _SUBPROCESS, ids=[_id(c) for c in _SUBPROCESS])
def test_real_cli_reports_bad_input_in_one_line(args, fragments, paths, tmp_path):
    _cli_case(args, fragments, paths, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("args,fragments", BAD_INPUTS, ids=[_id(c) for c in BAD_INPUTS])
def test_real_cli_whole_battery(args, fragments, paths, tmp_path):
    _cli_case(args, fragments, paths, tmp_path)


def test_hydra_full_error_shows_hydras_own_report(tmp_path):
    proc = run_module("gradrepro", "optim.lrr=0.1", f"hydra.run.dir={tmp_path / 'run'}",
                      env={"HYDRA_FULL_ERROR": "1"}, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "gradrepro: error" not in proc.stderr


def test_hydra_help_and_cfg_still_work(tmp_path):
    shown = run_module("gradrepro", "--cfg", "job", "experiment=simsiam_baseline", timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "name: simsiam_baseline" in shown.stdout
    helped = run_module("gradrepro", "--help", timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "experiment" in helped.stdout and "Override anything" in helped.stdout


def test_valid_sweep_and_search_path_pass_the_preflight(paths):
    preflight.check(["-m", "experiment=glob(simsiam_*)", "seed=0,1", "scale=tiny"])
    (paths["extra"] / "experiment" / "fine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - simsiam_baseline\n  - _self_\nname: fine\n")
    preflight.check(["--config-dir", str(paths["extra"]), "experiment=fine"])
    preflight.check([f"hydra.searchpath=[file://{paths['extra']}]", "experiment=fine"])
    preflight.check(["+paper.note=free-form keys are fine here"])
