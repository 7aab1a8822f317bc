"""Reference runs: other experiments a run makes itself (config ``references``), with the
same seed, scale, device, threads, step budget and fp16 path, into ``run_dir/references/NAME``, so that
a check ``relative_to: NAME`` ("final loss at least 2x fp32's") still reads only what this
run recorded."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any, Callable, Dict, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from gradrepro.config.compose import compose
from gradrepro.records.reader import read_run
from gradrepro.records.run import RunRecords

log = logging.getLogger(__name__)

# What a reference run shares with the run that asked for it: what makes two runs
# comparable (seed, device, threads, step budget, scale), not the knob under study.
REFERENCE_CARRY = ("seed", "device", "threads", "train.steps")
REFERENCE_MARK = "+_reference_of"
FP16_PATHS = ("fp16", "fp16_emulated")  # two ways to compute in fp16: real autocast, emulation

TrainFn = Callable[[DictConfig, Path, Sequence[str]], Dict[str, Any]]


def is_reference(overrides: Sequence[str]) -> bool:
    """Whether these are a reference run's overrides (a reference makes no references)."""
    return any(o.startswith(REFERENCE_MARK) for o in overrides)


def run_references(cfg: DictConfig, run_dir: Path, overrides: Sequence[str],
                   train: TrainFn) -> Tuple[Dict[str, RunRecords], Dict[str, Dict[str, Any]]]:
    """Run each reference experiment with ``train`` (the runner's ``run``) and return
    (records by name, the essentials of each reference's summary)."""
    carried = [f"{key}={OmegaConf.select(cfg, key)}" for key in REFERENCE_CARRY]
    carried += [o for o in overrides if o.startswith("scale=")]
    records, runs = {}, {}
    for name, experiment in cfg.references.items():
        ref_overrides = [f"experiment={experiment}", *carried]
        ref_cfg = compose(ref_overrides)
        path = fp16_path_override(cfg, ref_cfg)
        if path:
            ref_overrides.append(path)
            ref_cfg = compose(ref_overrides)
        ref_dir = run_dir / "references" / name
        log.info("reference %s: experiment=%s", name, experiment)
        with contextlib.redirect_stdout(io.StringIO()):
            summary = train(ref_cfg, ref_dir, [*ref_overrides, f"{REFERENCE_MARK}={cfg.name}"])
        ref = read_run(ref_dir)
        records[name] = RunRecords(ref.scalars(), ref.modules(), summary["constants"])
        runs[name] = {"experiment": experiment, "overrides": ref_overrides,
                      "status": summary["status"], "wall_s": summary["wall_s"],
                      "run_dir": f"references/{name}"}
    return records, runs


def fp16_path_override(cfg: DictConfig, ref_cfg: DictConfig) -> str:
    """The fp16 path is part of what makes two runs comparable: a reference that computes in
    fp16 follows the run's path (real autocast or its emulation); an fp32 reference stays fp32,
    since its precision is the knob under study. Returns the override, or ''."""
    mode, ref_mode = cfg.precision.mode, ref_cfg.precision.mode
    if mode in FP16_PATHS and ref_mode in FP16_PATHS and mode != ref_mode:
        return f"precision.mode={mode}"
    return ""
