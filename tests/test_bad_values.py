"""Values that passed the checks and then crashed or misled (a batch of one with BatchNorm,
learning rates beyond float32, thread counts beyond the machine, deletions of required keys,
nested lists, an empty run folder, a logger folder outside the run folder, --help with a
misspelt override, messages naming no key): each is one line and exit code 2 now. Then the
class of problem: generated command lines through the real entry point (Hydra included,
training included), with no traceback, ever."""

from __future__ import annotations

import io
import json
import os
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import TRACEBACK_MARKERS, assert_clean_error
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gradrepro import cli
from gradrepro.config.resolvers import usable_cores
from gradrepro.config.validate import check_reference_name
from gradrepro.errors import UserError

TINY = ["scale=tiny", "train.steps=2", "eval.every=0"]


def run_main(argv, run_dir: Path) -> tuple:
    """The real entry point in-process (``python -m gradrepro ARGV``, Hydra and all):
    (exit code, stdout, stderr)."""
    argv = [*argv, f"hydra.run.dir={run_dir}"] if not any(a.startswith("hydra.run.dir") for a in argv) else argv
    out, err, old = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["gradrepro", *argv]
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")
            cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = old
    return code, out.getvalue(), err.getvalue()


# (command line, fragments of the one error line)
REFUSED = [
    (["experiment=simsiam_baseline", "data.batch_size=1"], ["batch of one example", "BatchNorm"]),
    (["experiment=simsiam_baseline", "data.n_train=1"], ["batch of one example"]),
    (["optim.lr=1e39"], ["optim.lr=1e+39", "float32"]),
    (["optim.lr=1e-50"], ["optim.lr", "float32"]),
    (["optim.weight_decay=1e300"], ["optim.weight_decay", "float32"]),
    (["init=normal", "init.std=1e40"], ["init.std", "float32"]),
    ([f"threads={usable_cores() + 1}"], ["threads", "core"]),
    (["threads=3000000000"], ["threads"]),
    (["~train"], ["~train", "requires", "train=VALUE"]),
    (["~optim.lr"], ["~optim.lr", "requires"]),
    (["~optim.nope"], ["'optim.nope'", "deleted with '~'", "lr"]),
    (["model=convnet", "objective=missing_grad"], ["objective=missing_grad needs model=missing_grad"]),
    (["train.freeze=[[encoder]]"], ["train.freeze[0]", "list of str"]),
    (["model.widths=[[8]]"], ["model.widths[0]", "list of int"]),
    (["experiment=simsiam_baseline", "model.pool=sum"], ["model.pool='sum'", "max, avg"]),
    (["hydra.run.dir="], ["hydra.run.dir is empty"]),
    (["logger=tensorboard", "logger.folder=/tmp/elsewhere"], ["logger.folder", "inside the run folder"]),
    (["logger=tensorboard", "logger.folder=../up"], ["logger.folder"]),
    (["--help", "trian.steps=3"], ["unknown config key 'trian'"]),
    (["--cfg", "job", "optim.lrr=1"], ["unknown config key 'optim.lrr'"]),
    (["experiment=simsiam_baseline", "objective.dim=-1"], ["threshold", "sqrt(-1)", "objective.dim=-1"]),
    (["experiment=../../etc/passwd"], ["experiment='../../etc/passwd'", "not a config name", "simsiam_baseline"]),
    (["optim.lr=${{calc:'9**9**9'}}"], ["optim.lr", "beyond the float range"]),
    (["+references.x=nope"], ["references.x='nope'", "not an experiment"]),
    (["-m", "+references.x=nope", "seed=0,1"], ["references.x='nope'"]),
    # 1e14 parameters: more memory than any machine has, refused before anything is allocated
    (["model.widths=[10000000,10000000]"], ["needs at least", "GiB", "free here"]),
]


@pytest.mark.parametrize("argv,fragments", REFUSED, ids=[" ".join(a)[:50] for a, _ in REFUSED])
def test_bad_values_are_one_line_and_exit_2(argv, fragments, tmp_path):
    argv = [a.replace("{{", "{").replace("}}", "}") for a in argv]
    run_dir = tmp_path / "run"
    if "-m" in argv:
        argv = [*argv, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    flags = [a for a in argv if a.startswith("-")] + (["job"] if "--cfg" in argv else [])
    code, out, err = run_main([*flags, *TINY, *(a for a in argv if a not in flags)], run_dir)
    assert_clean_error(code, err, *fragments)
    if run_dir.exists():  # refused by the run itself (after Hydra made the folder): said there
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["steps"] == 0


@pytest.mark.parametrize("name", ["../x", "a/b", ".", "..", "", "-x", "x y"])
def test_a_reference_name_must_be_a_plain_folder_name(name):
    with pytest.raises(UserError, match="plain folder name"):
        check_reference_name(name)
    check_reference_name("fp32_control.v2")


def test_a_model_that_does_not_fit_is_named_for_what_went_wrong(tmp_path):
    code, out, err = run_main([*TINY, "model.num_classes=2"], tmp_path / "run")
    line = assert_clean_error(code, err, "labels beyond the model's outputs", "Target")
    assert "device" not in line


# --- the class of problem: generated command lines through the real entry point --------------

KEYS = {
    "seed": ["0", "1", "-1", "4294967296"],
    "threads": ["1", "0", "64", "99999999999"],
    "train.steps": ["0", "1", "2", "-1"],
    "optim.lr": ["0.05", "0", "1e30", "1e39", "1e-50", "nan", "inf", "-1"],
    "optim.weight_decay": ["0", "1e-4", "1e300", "-1"],
    "optim.momentum": ["0", "0.9", "5", "1e39"],
    "optim.name": ["sgd", "adam", "adamw", "lbfgs"],
    "optim.schedule": ["constant", "cosine"],
    "train.grad_clip": ["null", "1.0", "0", "1e40"],
    "train.freeze": ["[]", "[encoder]", "[[a]]", "[nope]"],
    "train.eval_modules": ["[]", "[[x]]"],
    "data.batch_size": ["1", "2", "32", "0"],
    "data.n_train": ["1", "2", "64", "0"],
    "data.n_test": ["1", "16"],
    "data.views": ["true", "false"],
    "model": ["mlp", "convnet", "missing_grad"],
    "model.num_classes": ["0", "1", "2", "10"],
    "model.widths": ["[8]", "[[8]]", "[]", "[0]"],
    "model.batchnorm": ["true", "false"],
    "objective": ["classification", "simsiam", "missing_grad"],
    "init": ["default", "kaiming", "normal"],
    "init.std": ["0.01", "0", "1e40"],
    "precision": ["fp32", "fp16_noscale", "fp16_dynamic"],
    "probe.every": ["1", "2", "0"],
    "probe.tiny_factor": ["1e4", "0", "nan"],
    "logger": ["none"],
    "logger.folder": ["tb", "/tmp/x", "../x", "''"],
    "~train": [None], "~optim.lr": [None], "~paper": [None],
    "+references.x": ["nope", "simsiam_baseline"],
    "hydra.run.dir": ["''"],
}
OVERRIDE = st.sampled_from(sorted(KEYS)).flatmap(
    lambda k: st.sampled_from(KEYS[k]).map(lambda v: k if v is None else f"{k}={v}"))


def check_outcome(code: int, out: str, err: str) -> str:
    """0 (ran), 2 (refused, one line) or 1 (records incomplete, one line); never a traceback."""
    assert not any(m in out + err for m in TRACEBACK_MARKERS), err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 0:
        return "ran"
    assert code in (1, 2) and len(lines) == 1 and lines[0].startswith("gradrepro: error: "), (code, err)
    return "refused"


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(max_examples=int(os.environ.get("GRADREPRO_ENTRY_EXAMPLES", "12")), **_SETTINGS)
@given(overrides=st.lists(OVERRIDE, min_size=1, max_size=4, unique_by=lambda o: o.split("=")[0]))
def test_generated_command_lines_never_give_a_traceback(overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("entry") / "run"
    code, out, err = run_main(["scale=tiny", "train.steps=2", "eval.every=0", "data.n_test=16", *overrides],
                              run_dir)
    event(check_outcome(code, out, err))
    if run_dir.exists() and code != 0:  # the run started, then refused: its summary says so
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("GRADREPRO_ENTRY_EXAMPLES_SLOW", "150")), **_SETTINGS)
@given(overrides=st.lists(OVERRIDE, min_size=1, max_size=6, unique_by=lambda o: o.split("=")[0]))
def test_many_generated_command_lines_never_give_a_traceback(overrides, tmp_path_factory):
    test_generated_command_lines_never_give_a_traceback.hypothesis.inner_test(overrides, tmp_path_factory)


def test_a_place_for_the_pre_step_copy_that_does_not_exist_is_one_line(tmp_path):
    code, out, err = run_main([*TINY, "probe.before_on=gpu"], tmp_path / "run")
    assert_clean_error(code, err, "probe.before_on='gpu' is not valid", "choose one of: device, host")
