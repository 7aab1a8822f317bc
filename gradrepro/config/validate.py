"""Checks a composed config before any run starts: keys the schema does not declare, ranges,
choices, what this machine offers, and a signature's metric names. Each failure is one
``UserError`` line naming the key, the problem and the valid choices."""

from __future__ import annotations

import difflib
import fnmatch
import math
import os
import re
from pathlib import PurePosixPath
from typing import Any, List, Sequence, Set

import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from gradrepro.config.compose import group_options_recursive
from gradrepro.config.numbers import check_numbers
from gradrepro.config.resolvers import usable_cores
from gradrepro.config.sizes import check_sizes
from gradrepro.config.structure import check_flat_lists, undeclared_keys
from gradrepro.data.cifar10 import check_cifar10_root
from gradrepro.errors import UserError
from gradrepro.measure import MEASUREMENTS, produced_by
from gradrepro.measure.reference_runs import made_references
from gradrepro.objectives import ACCUMULATE_NORMS, OBJECTIVES
from gradrepro.probe.config import BEFORE_ON
from gradrepro.recipe.bf16 import BF16_UPDATES
from gradrepro.recipe.clipping import CLIP_ORDERS, CLIP_SCALARS, NORM_SOURCES
from gradrepro.recipe.init import INIT_MODES, INIT_SCHEMES
from gradrepro.recipe.optim import OPTIMIZERS, SCHEDULES
from gradrepro.recipe.precision import PRECISION_MODES, is_power_of_two
from gradrepro.records import LOGGERS, tensorboard_available
from gradrepro.records.run import RUN_CONSTANTS, RUN_SCALARS
from gradrepro.records.summary_schema import CLAIM_KINDS
from gradrepro.signature import DIFFERENCES, METRIC_NEEDS, METRICS, OPS, ROLES, TRANSFORMS


def did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close and close[0] != word else ""


def unknown_key_message(key: str, valid: Sequence[str], where: str = "", note: str = "") -> str:
    """``unknown config key 'a.b' in X (did you mean ...); valid keys under a: ...``."""
    parent, _, leaf = key.rpartition(".")
    location = (f" in {where}" if where else "") + (f" ({note})" if note else "")
    hint = did_you_mean(leaf, valid) if valid else ""
    listing = (f"; valid keys{' under ' + parent if parent else ''}: {', '.join(valid)}"
               if valid else "")
    return f"unknown config key {key!r}{location}{hint}{listing}"


def validate(cfg: Any) -> None:
    """Range, choice, availability and signature checks the schema's types cannot express.
    Raises UserError."""
    for key, valid in undeclared_keys(cfg)[:1]:
        raise UserError(unknown_key_message(key, valid, note="added with '+'"))
    check_flat_lists(cfg)
    _check_name(cfg)
    check_sizes(cfg)
    _check_ranges(cfg)
    _check_choices(cfg)
    _check_machine(cfg)
    _check_paths(cfg)
    _check_references(cfg)
    _check_processes(cfg)
    _check_signature(cfg)
    check_numbers(cfg)  # every other number: finite, and within what its consumer holds


def _choice(key: str, value: Any, valid: Any) -> None:
    if value not in valid:
        raise UserError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{key}={value} must be a finite number {'>= 0' if allow_zero else '> 0'}")


# float32's range (IEEE 754 binary32): the parameters, and so every value multiplied into them,
# are float32; a value beyond the largest finite one is inf there, one below the smallest
# positive (subnormal) one is 0.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINIEST = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23


def _float32(key: str, value: float) -> None:
    if value != 0 and not FLOAT32_TINIEST <= abs(value) <= FLOAT32_MAX:
        raise UserError(f"{key}={value} is outside float32's range ({FLOAT32_TINIEST:.3g} to {FLOAT32_MAX:.4g}): "
                        f"the parameters are float32, where it would be {'inf' if abs(value) > 1 else '0'}")


def _unit(key: str, value: float) -> None:  # torch's optimizers reject values outside [0, 1)
    if not (math.isfinite(value) and 0 <= value < 1):
        raise UserError(f"{key}={value} must be >= 0 and < 1")


def _check_ranges(cfg: Any) -> None:
    _positive("train.steps", cfg.train.steps, allow_zero=True)
    _positive("optim.lr", cfg.optim.lr, allow_zero=cfg.train.steps == 0)
    if not 0 <= cfg.seed < 2**32:  # numpy's seed range
        raise UserError(f"seed={cfg.seed} must be >= 0 and < 2**32")
    _positive("optim.momentum", cfg.optim.momentum, allow_zero=True)
    _positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    if len(cfg.optim.betas) != 2:
        raise UserError(f"optim.betas={list(cfg.optim.betas)} must be two numbers, e.g. [0.9,0.999]")
    for i, beta in enumerate(cfg.optim.betas):
        _unit(f"optim.betas[{i}]", beta)
    if cfg.train.grad_clip is not None:
        _positive("train.grad_clip", cfg.train.grad_clip)
    _check_accumulation(cfg)
    for key, allow_zero in (("init.std", True), ("probe.every", False), ("probe.act_sample", False),
                            ("probe.tiny_factor", False), ("eval.every", True), ("eval.knn_k", False),
                            ("threads", False), ("data.batch_size", False), ("data.n_train", False),
                            ("data.n_test", False), ("signature.window", False),
                            ("probe.running_sum_steps", True)):
        _positive(key, OmegaConf.select(cfg, key), allow_zero=allow_zero)
    _choice("probe.before_on", cfg.probe.before_on, BEFORE_ON)
    if cfg.eval.mode_pass.mode is not None:
        _choice("eval.mode_pass.mode", cfg.eval.mode_pass.mode, ("eval", "train"))
        _positive("eval.mode_pass.batch_size", cfg.eval.mode_pass.batch_size)
        for size in cfg.eval.mode_pass.small_batches:
            _positive("eval.mode_pass.small_batches[]", size)
    if str(cfg.precision.loss_scale) != "dynamic":
        try:
            scale = float(cfg.precision.loss_scale)
        except (TypeError, ValueError):
            raise UserError(
                f"precision.loss_scale={cfg.precision.loss_scale!r} must be a number > 0 or 'dynamic'"
            ) from None
        _positive("precision.loss_scale", scale)
    for key in ("optim.lr", "optim.weight_decay", "optim.momentum", "train.grad_clip", "init.std"):
        if OmegaConf.select(cfg, key) is not None:
            _float32(key, float(OmegaConf.select(cfg, key)))
    if str(cfg.precision.loss_scale) != "dynamic":
        _float32("precision.loss_scale", float(cfg.precision.loss_scale))
    _positive("precision.scaler_init_scale", cfg.precision.scaler_init_scale)
    _positive("precision.scaler_growth_interval", cfg.precision.scaler_growth_interval)
    _float32("precision.loss_shift", float(cfg.precision.loss_shift))  # 2**200 is a power of two, inf in float32
    if not is_power_of_two(cfg.precision.loss_shift):
        raise UserError(
            f"precision.loss_shift={cfg.precision.loss_shift} must be a power of two (e.g. 2^-16 = "
            "1.52587890625e-05) so that it leaves fp32 training bit-identical"
        )


def _check_accumulation(cfg: Any) -> None:
    accumulate, batch = cfg.train.accumulate, cfg.data.batch_size
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UserError(f"train.accumulate={accumulate} must be a whole number >= 1 (micro-batches per step)")
    if batch % accumulate:
        raise UserError(f"train.accumulate={accumulate} must divide data.batch_size={batch}: the batch is split "
                        f"into equal micro-batches (e.g. train.accumulate="
                        f"{max(d for d in range(1, min(accumulate, batch) + 1) if batch % d == 0)})")
    _choice("train.accumulate_norm", cfg.train.accumulate_norm, ACCUMULATE_NORMS)


def _check_choices(cfg: Any) -> None:
    _choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _choice("optim.schedule", cfg.optim.schedule, SCHEDULES)
    _choice("init.scheme", cfg.init.scheme, INIT_SCHEMES)
    _choice("init.mode", cfg.init.mode, INIT_MODES)
    if cfg.init.reference is not None:
        _choice("init.reference", cfg.init.reference, INIT_SCHEMES)
    _choice("precision.mode", cfg.precision.mode, PRECISION_MODES)
    _choice("precision.bf16_update", cfg.precision.bf16_update, BF16_UPDATES)
    if cfg.precision.mode == "bf16" and (str(cfg.precision.loss_scale) == "dynamic"
                                         or float(cfg.precision.loss_scale) != 1.0):
        raise UserError(f"precision.mode=bf16 takes no loss scale (precision.loss_scale={cfg.precision.loss_scale}): "
                        "bf16 has fp32's exponent range; set precision.loss_scale=1.0")
    _choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _choice("logger.name", cfg.logger.name, LOGGERS)
    if cfg.signature.checks:  # a verdict says what it proves
        _choice("claim_kind", cfg.claim_kind, CLAIM_KINDS)
    _choice("train.clip_order", cfg.train.clip_order, CLIP_ORDERS)
    _choice("train.clip_norm_from", cfg.train.clip_norm_from, NORM_SOURCES)
    for i, check in enumerate(cfg.signature.checks):
        _choice(f"signature.checks[{i}].op", check.op, tuple(OPS))
        _choice(f"signature.checks[{i}].role", check.role, ROLES)


def _check_processes(cfg: Any) -> None:
    """A run of several processes (train/distributed.py): each takes an equal slice of every
    batch; reference runs are made by single-process runs only."""
    processes = cfg.distributed.processes
    if processes < 1:
        raise UserError(f"distributed.processes={processes} must be 1 or more")
    _positive("distributed.timeout_s", cfg.distributed.timeout_s)
    if processes == 1:
        return
    most = max(2, usable_cores())  # each process is a whole run on this machine; two always may run
    if processes > most:
        raise UserError(f"distributed.processes={processes} is more processes than this machine's "
                        f"{usable_cores()} CPU core(s) can run side by side; choose 1 to {most}")
    if cfg.data.batch_size % processes:
        raise UserError(f"data.batch_size={cfg.data.batch_size} must be a multiple of distributed.processes="
                        f"{processes}: each process takes an equal slice of every batch")
    share = cfg.data.batch_size // processes
    if share % cfg.train.accumulate:
        raise UserError(f"train.accumulate={cfg.train.accumulate} must divide each process's slice of the batch "
                        f"(data.batch_size={cfg.data.batch_size} / distributed.processes={processes} = {share})")
    if made_references(cfg):
        raise UserError(f"references are made by single-process runs only; distributed.processes={processes} "
                        "runs without them (set references={} or distributed.processes=1)")


def _check_machine(cfg: Any) -> None:
    """What this machine must offer: a GPU, an optional package, a local data folder, cores."""
    cores = usable_cores()
    if cfg.threads > cores:  # more threads than cores only contend (and a huge count overloads the machine)
        raise UserError(f"threads={cfg.threads} is more than the {cores} CPU core(s) this process may use; "
                        f"choose 1 to {cores}")
    if cfg.logger.name == "tensorboard" and not tensorboard_available():
        raise UserError("logger=tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is available here; use device=cpu or device=auto")
    if cfg.data.name == "cifar10":
        check_cifar10_root(os.path.expanduser(cfg.data.root))


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


def _check_name(cfg: Any) -> None:
    """``name`` labels the run (summary.json, compare) and is part of the default folder name:
    a path separator would nest folders, an interpolation would label the run with whatever
    it resolves to. A plain name only, or an experiment's own name (its config's path)."""
    if OmegaConf.is_interpolation(cfg, "name"):
        raise UserError(f"name={OmegaConf.to_container(cfg)['name']!r} is an interpolation: a run's name is "
                        "written as is (letters, digits, '_', '-', '.', '+'), e.g. name=my_run")
    name = cfg.name
    if isinstance(name, str) and "/" in name and name in experiment_options():
        return  # an experiment in a subfolder is named by its config's path (missing_grad/frozen)
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise UserError(f"name={name!r} is not a plain name: letters, digits, '_', '-', '.', '+' only "
                        "(no path separator, no spaces), e.g. name=my_run")


def _check_paths(cfg: Any) -> None:
    """Folders a run writes lie inside its run folder (``logger.folder``)."""
    if cfg.logger.name != "none":
        folder = str(cfg.logger.folder)
        parts = PurePosixPath(folder.replace("\\", "/")).parts
        if not folder.strip() or PurePosixPath(folder).is_absolute() or ".." in parts or folder.startswith("~"):
            raise UserError(f"logger.folder={folder!r} must be a folder inside the run folder (a relative "
                            "path without '..'), e.g. logger.folder=tensorboard")


_REFERENCE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def check_reference_name(name: Any) -> None:
    """A reference's name is a folder of the run folder (``references/NAME``)."""
    if not isinstance(name, str) or not _REFERENCE_NAME.match(name) or name in (".", ".."):
        raise UserError(f"references.{name}: a reference name must be a plain folder name "
                        "(letters, digits, '_', '-', '.'; no '/')")


def experiment_options() -> List[str]:
    """Every experiment name: gradrepro's own, and those of a running Hydra's search path."""
    names = set(group_options_recursive("experiment"))
    if GlobalHydra.instance().is_initialized():
        names |= set(GlobalHydra.instance().config_loader().get_group_options("experiment"))
    return sorted(names)


def _check_references(cfg: Any) -> None:
    """Reference runs name experiments that exist, under plain folder names."""
    options = None
    for name in cfg.references or {}:
        check_reference_name(name)
    for name, experiment in made_references(cfg).items():  # null: an inherited one dropped
        options = options or experiment_options()
        if not isinstance(experiment, str) or experiment not in options:
            raise UserError(f"references.{name}={experiment!r} is not an experiment"
                            f"{did_you_mean(str(experiment), options)}; valid choices: {', '.join(options)}")


def produced_names(cfg: Any) -> Set[str]:
    """Every name a check may read from this run's records, known from the config alone:
    derived metrics, scalars (the loop's, the objective's, its evaluations), and constants
    (evaluations at init, and what each measurement this config switches on records), as
    names and fnmatch patterns."""
    objective = OBJECTIVES[cfg.objective.name][1]
    names = set(METRICS) | set(RUN_SCALARS) | set(objective.TRAIN_SCALARS) | set(objective.EVAL_SCALARS)
    names |= {f"{k}_init" for k in objective.EVAL_SCALARS} | set(RUN_CONSTANTS)
    if cfg.train.grad_clip:
        names |= set(CLIP_SCALARS)
    constants, columns = produced_by(cfg)
    return names | constants | columns


def _switched_off(cfg: Any, names: Sequence[str]) -> str:
    """The measurement that records one of ``names`` but that ``cfg`` does not switch on, as
    'NAME, which this run does not record: set SWITCH', or ''."""
    for cls in MEASUREMENTS.values():
        recorded = (*cls.constants, *cls.columns)
        if not cls.enabled(cfg) and any(fnmatch.fnmatchcase(str(n), r) for n in names for r in recorded):
            return f"{cls.name}, which this run does not record: set {cls.switch}"
    return ""


def _check_signature(cfg: Any) -> None:
    """A check must read something the run records, and compare with a reference it makes."""
    produced = produced_names(cfg)
    literal = sorted(n for n in produced if not any(c in n for c in "*?["))
    references = list(made_references(cfg))
    for i, check in enumerate(cfg.signature.checks):
        params = check.get("params") or {}
        name = check.metric if check.metric in METRICS else params.get("column", check.metric)
        needs = METRIC_NEEDS.get(name, ()) if check.metric in METRICS else (name,)
        missing = [n for n in needs if not any(fnmatch.fnmatchcase(str(n), p) for p in produced)]
        off = _switched_off(cfg, missing) if missing else ""
        if off:
            raise UserError(f"signature.checks[{i}].metric={name!r} reads {off}")
        if not any(fnmatch.fnmatchcase(str(name), n) for n in produced):
            close = difflib.get_close_matches(str(name), literal, n=3)
            raise UserError(
                f"signature.checks[{i}].metric={name!r} is recorded by nothing in this run"
                + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                + f"; known names: {', '.join(literal)}")
        for key, valid in (("transform", TRANSFORMS), ("how", DIFFERENCES)):
            if params.get(key) is not None and params.get(key) not in valid:
                raise UserError(f"signature.checks[{i}].params.{key}={params.get(key)!r} is not valid; "
                                f"choose one of: {', '.join(valid)}")
        for key in ("relative_to", "closer_to", "than", "reference"):
            ref = params.get(key)
            if ref is not None and ref not in references:
                raise UserError(
                    f"signature.checks[{i}].params.{key}={ref!r} names no reference run; "
                    f"this experiment's references: {', '.join(references) or 'none'}")


__all__: List[str] = ["did_you_mean", "produced_names", "undeclared_keys", "unknown_key_message", "validate"]
