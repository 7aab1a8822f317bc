"""Checks of what a command line asks for that composing alone gets wrong or says badly:
config names that leave their group (``experiment=../../x``), deletions of keys the schema
requires (``~train``), and reference runs (``references``) that name no experiment or whose
composed config would be refused, all before any run starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from typing import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from omegaconf import DictConfig, OmegaConf

from gradrepro.cli.messages import explain
from gradrepro.config.compose import Compose, group_options_recursive
from gradrepro.config.schema import SCHEMA_SUFFIX
from gradrepro.config.validate import check_reference_name, unknown_key_message, validate
from gradrepro.errors import UserError
from gradrepro.measure.reference_runs import made_references, reference_overrides


def _parsed(overrides: Sequence[str]) -> list:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - a syntax error: composing reports it with its own words
        return []


def _is_group(key: str, config_dir: Path) -> bool:
    return key.startswith("hydra/") or (Path(config_dir) / key).is_dir()


def check_choice_names(overrides: Sequence[str], config_dir: Path) -> None:
    """``group=NAME``: NAME is a config inside the group, never a path out of it, never the
    schema registered beside it (``mlp_schema``), and one name, not a list to merge."""
    for o in _parsed(overrides):
        group = o.key_or_group
        _check_subfolder_spelling(o, config_dir)
        if not _is_group(group, config_dir) or isinstance(o.value(), Glob):
            continue
        if not group.startswith("hydra/") and not o.is_sweep_override() and isinstance(o.value(), list):
            # Hydra reads group=[a,b] as "merge a and b": one run, labelled as one of them.
            listed = ",".join(map(str, o.value()))
            raise UserError(f"{group}={o.value()!r} merges several {group} configs into one run, labelled as "
                            f"one of them; choose one ({group}=NAME), or run each: -m {group}={listed}")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            if str(value).endswith(SCHEMA_SUFFIX) and not group.startswith("hydra/"):
                options = group_options_recursive(group, config_dir)
                if str(value) not in options:
                    raise UserError(f"{group}={value!r} is the type schema behind a {group} choice, not a choice; "
                                    f"valid choices: {', '.join(options)}")
            parts = PurePosixPath(str(value)).parts
            if str(value).startswith(("/", "\\")) or ".." in parts:
                options = group_options_recursive(group, config_dir)
                raise UserError(f"{group}={value!r} is not a config name: a choice names a config of the "
                                f"{group} group (no '..', no leading '/'); valid choices: {', '.join(options)}")


def _check_subfolder_spelling(o, config_dir: Path) -> None:
    """``experiment/missing_grad=detached``: a subfolder of a group is not a group of the
    defaults list (Hydra says "No match in the defaults list"); a config in it is chosen by
    its path, ``experiment=missing_grad/detached``."""
    group = o.key_or_group
    top, _, sub = group.partition("/")
    if not sub or group.startswith("hydra/") or o.is_add() or o.is_delete() or not _is_group(top, config_dir):
        return
    values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
    spelt = ",".join(f"{sub}/{v}" for v in values)
    options = group_options_recursive(top, config_dir)
    given = f"{group}={','.join(map(str, values))} is not how a config in a subfolder of {top} is chosen"
    if all(f"{sub}/{v}" in options for v in values):
        raise UserError(f"{given}: write {top}={spelt}")
    inside = [n for n in options if n.startswith(f"{sub}/")]
    raise UserError(f"{given}: write {top}={sub}/NAME; valid choices: {', '.join(inside)}")


def check_deletions(compose: Compose, overrides: Sequence[str], config_name: str, config_dir: Path) -> None:
    """``~key``: a key the schema declares cannot be deleted (the code reads it); a key that
    does not exist is named with the keys that do. Free-form mappings (``paper``, a check's
    ``params``, ``references``) and config groups (``~scale``) may lose entries."""
    parsed = _parsed(overrides)
    deletions = [o for o in parsed if o.is_delete() and not _is_group(o.key_or_group, config_dir)]
    if not deletions:
        return
    kept = [raw for raw, o in zip(overrides, parsed) if all(o is not d for d in deletions)]
    try:
        cfg = compose(kept, config_name=config_name)
    except Exception:  # noqa: BLE001 - the config is wrong without the deletion too: reported later
        return
    for o in deletions:
        key = o.key_or_group
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or leaf not in node:
            valid = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
            raise UserError(unknown_key_message(key, valid, note="deleted with '~'"))
        schema = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(schema) and leaf in {f.name for f in dataclasses.fields(schema)}:
            raise UserError(f"~{key} deletes a key the config requires ({schema.__name__}.{leaf}); "
                            f"set it to another value instead ({key}=VALUE)")


def check_references(compose: Compose, cfg: DictConfig, config_name: str) -> None:
    """Each reference run is composed and validated as the run will compose it (same seed,
    scale, device, threads and steps), so a misspelt experiment is refused before training."""
    for name, experiment in made_references(cfg).items():
        check_reference_name(name)
        overrides = reference_overrides(cfg, [], experiment)
        try:
            ref_cfg = compose(overrides, config_name=config_name)
            OmegaConf.to_container(ref_cfg, resolve=True, throw_on_missing=True)
        except Exception as exc:  # noqa: BLE001 - Hydra raises many types
            raise UserError(f"references.{name}={experiment!r}: {explain(exc)}") from None
        try:
            validate(ref_cfg)
        except UserError as exc:
            raise UserError(f"references.{name}={experiment!r} would be refused: {exc}") from None
