"""``python -m gradrepro --help``: the config groups and the most used overrides, with the rest
one command away (``--cfg job``). It imports nothing heavy: ``--help`` alone is answered from
the package's config folder before torch or Hydra is imported (``gradrepro/__main__.py``; this
module lives outside ``gradrepro.cli``, whose import is the heavy one). With overrides or
another config folder, Hydra's help prints the same text with its search path's groups
(``${help_groups:}`` and ``${help_overrides:}`` in ``configs/config.yaml``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SCHEMA_SUFFIX = "_schema"  # a choice's schema in the ConfigStore: internal, never a choice
WIDTH = 100

USAGE = "usage: python -m gradrepro experiment=NAME [key=value ...]      (-m key=a,b: a sweep)"

# The overrides a first session uses, in the README's order; every other key: --cfg job.
OVERRIDES = (
    ("experiment=NAME", "the experiment (in a subfolder: missing_grad/detached)"),
    ("scale=tiny", "any experiment in seconds (a pipeline check, not a result)"),
    ("seed=N", "the seed"),
    ("device=auto|cpu|cuda", "where it runs"),
    ("threads=N", "CPU threads (each experiment sets a measured default)"),
    ("train.steps=N", "training steps"),
    ("optim.lr=X", "the learning rate"),
    ("data=NAME, model=NAME", "the data and model (choices above)"),
    ("precision.mode=fp32|fp16|bf16", "the numeric regime"),
    ("hydra.run.dir=PATH", "the run folder (default results/runs/DATE/TIME_NAME)"),
    ("-m key=a,b seed=0,1,2", "a sweep (in parallel: hydra/launcher=joblib)"),
)

MORE = (
    ("every key of the composed config", "python -m gradrepro experiment=NAME --cfg job [--resolve]"),
    ("Hydra's own flags", "python -m gradrepro --hydra-help"),
    ("what a run does; sweeps, launchers", "README.md, docs/sweeps.md"),
)


def wrapped(name: str, items: List[str]) -> str:
    """``name: a, b, c`` wrapped to WIDTH, continuation lines indented."""
    return textwrap.fill(f"{name}: {', '.join(items)}", WIDTH, subsequent_indent="    ",
                         break_on_hyphens=False, break_long_words=False)


def groups_in(config_dir: Path = CONFIG_DIR) -> Dict[str, List[str]]:
    """``{group: choices}`` from a config folder; a subfolder's configs are choices of its top
    group, named by their path (``experiment: ..., missing_grad/detached``)."""
    groups: Dict[str, List[str]] = {}
    for folder in sorted(p for p in Path(config_dir).iterdir() if p.is_dir() and p.name != "hydra"):
        choices = sorted(str(f.relative_to(folder).with_suffix("")) for f in folder.rglob("*.yaml"))
        if choices:
            groups[folder.name] = [c for c in choices if not c.endswith(SCHEMA_SUFFIX)]
    return groups


def listing(groups: Dict[str, List[str]]) -> str:
    return "\n".join(wrapped(group, choices) for group, choices in sorted(groups.items()))


def overrides_text() -> str:
    left = max(len(k) for k, _ in (*OVERRIDES, *MORE)) + 2
    lines = ["== Most used overrides ==  (Override anything in the config: key=value)"]
    lines += [f"  {k.ljust(left)}{v}" for k, v in OVERRIDES]
    lines += ["", "== The rest =="] + [f"  {(k + ':').ljust(left)}{v}" for k, v in MORE]
    return "\n".join(lines)


def short_help(groups: str = "") -> str:
    """The whole ``--help`` text; ``groups``: the listing (default: the package's config folder)."""
    return "\n".join([USAGE, "", "== Config groups ==  (group=choice)", groups or listing(groups_in()), "",
                      overrides_text()])


def main() -> None:
    print(short_help())


__all__ = ["groups_in", "listing", "overrides_text", "short_help"]
