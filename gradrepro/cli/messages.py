"""Hydra's and OmegaConf's error messages turned into one line that names the key, the
problem and the valid choices. Hydra says these things in prose; the regular expressions
that read that prose live here and nowhere else."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, ValidationError

from gradrepro.config.compose import CONFIG_DIR, group_options_recursive
from gradrepro.config.schema import Config
from gradrepro.config.validate import did_you_mean, unknown_key_message
from gradrepro.data import DATA
from gradrepro.models import MODELS
from gradrepro.objectives import OBJECTIVES


def group_options(group: str) -> list[str]:
    """The choices of a config group, from the running (or composing) Hydra."""
    loader = GlobalHydra.instance().config_loader()
    return sorted(o for o in loader.get_group_options(group) if not o.endswith("_schema"))


def _schemas() -> dict[str, type]:
    """Every config dataclass by class name (the name Hydra's messages use)."""
    found: dict[str, type] = {}
    todo = [Config, *(schema for registry in (MODELS, DATA, OBJECTIVES) for schema, _ in registry.values())]
    while todo:
        cls = todo.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
                todo.append(factory)
    return found


def explain(exc: BaseException, last_cfg: Optional[Any] = None) -> str:
    """One line naming the problem and, where there are some, the valid choices.
    ``last_cfg``: the config composed last, whose keys are listed for an unknown key."""
    chain, err = [], exc
    while err is not None and len(chain) < 8:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return fill_placeholders(_explain(exc, last_cfg), *chain)


def _explain(exc: BaseException, last_cfg: Optional[Any] = None) -> str:
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    missing = re.search(r"Could not find '([^']+)'", text)
    if missing:
        path = missing.group(1)
        group, _, choice = path.rpartition("/")
        if group:
            local = CONFIG_DIR / group
            options = group_options_recursive(group) if local.is_dir() else group_options(group)
            return (f"unknown {group} {choice!r}{did_you_mean(choice, options)}; "
                    f"valid choices: {', '.join(options)}")
        return f"config {path!r} not found"
    where = re.match(r"In '([^']+)'", text)
    where = where.group(1) if where else ""
    for err in (exc, cause):
        if err is None:
            continue
        message = str(err)
        if isinstance(err, ConfigKeyError) or "not in struct" in message or "Key '" in message:
            key = re.search(r"Key '([^']+)'", message)
            full_key = (getattr(err, "full_key", None)
                        or (re.search(r"full_key: (\S+)", message) or [None, None])[1]
                        or (key.group(1) if key else "?"))
            valid = _valid_keys(err, message, full_key.rpartition(".")[0], last_cfg)
            return unknown_key_message(full_key, valid, where)
    for err in (exc, cause):
        if isinstance(err, InterpolationResolutionError) and getattr(err, "full_key", None):
            return _unresolvable(err, last_cfg)
    for err in (exc, cause):
        if isinstance(err, ValidationError):
            full_key = getattr(err, "full_key", "") or "?"
            first = str(err).splitlines()[0]
            return f"{full_key}: {first}" + (f" (in {where})" if where else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if len(lines) > 1 and (first.startswith(("In '", "Error parsing override"))):
        first = f"{first}: {lines[1]}"  # the second line says what is wrong
    unset = re.match(r"Missing mandatory value: (\S+)", first)
    if unset:
        key = unset.group(1)
        options = group_options(key) if "." not in key else []
        listing = f"; choose one of: {', '.join(options)}" if options else ""
        return f"{key} must be set (it is required and has no value){listing}"
    return first


_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.\[\]]*)\}")


def _unresolvable(err: BaseException, cfg: Any) -> str:
    """``KEY: why its interpolation failed; it reads A=1, B=2`` (the keys the expression uses,
    so that a value given elsewhere, ``objective.dim=-1``, is named)."""
    key = str(err.full_key)
    cause = err.__cause__ or err.__context__
    why = str(cause).splitlines()[0] if cause is not None and str(cause) else str(err).splitlines()[0]
    why = re.sub(r"^\w+ raised while resolving interpolation: ", "", why)
    raw, reads = _raw_value(cfg, key), []
    for ref in dict.fromkeys(_REFERENCE.findall(raw or "")):
        try:
            value = OmegaConf.select(cfg, ref, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001 - a reference that cannot be read: left out
            continue
        if value is not None and not isinstance(value, (DictConfig, ListConfig)):
            reads.append(f"{ref}={value}")
    if _PLACEHOLDER.search(why):  # the cause's text is a template; the error itself has it filled in
        why = re.sub(r"^While dereferencing interpolation '[^']*': ", "", str(err).splitlines()[0])
    shown = f" = {raw}" if raw else ""
    return f"{key}{shown}: {why}" + (f" (it reads {', '.join(reads)})" if reads else "")


# OmegaConf's message templates: an error raised below the node it concerns keeps them unfilled.
_PLACEHOLDER = re.compile(r"\$(VALUE_TYPE|VALUE|FULL_KEY|KEY_TYPE|KEY|OBJECT_TYPE|REF_TYPE)\b")


def fill_placeholders(text: str, *errors: Optional[BaseException]) -> str:
    """``text`` with OmegaConf's ``$VALUE``, ``$VALUE_TYPE``, ``$KEY``, ... filled from the first
    error of ``errors`` that knows each, else said in words ("the value", "its type")."""
    def known(name: str) -> Optional[str]:
        for err in errors:
            if err is None:
                continue
            if name == "VALUE_TYPE" and getattr(err, "value", None) is not None:
                return type(err.value).__name__
            attr = {"VALUE": "value", "FULL_KEY": "full_key", "KEY": "key", "OBJECT_TYPE": "object_type_str",
                    "REF_TYPE": "ref_type_str", "KEY_TYPE": "key"}[name]
            value = getattr(err, attr, None)
            if value is not None and value != "":
                return type(value).__name__ if name == "KEY_TYPE" else str(value)
        return None

    words = {"VALUE": "the value", "VALUE_TYPE": "its type", "KEY": "the key", "FULL_KEY": "the key",
             "OBJECT_TYPE": "the config", "REF_TYPE": "the config", "KEY_TYPE": "the key's type"}
    return _PLACEHOLDER.sub(lambda m: known(m.group(1)) or words[m.group(1)], text)


def _raw_value(cfg: Any, key: str) -> Optional[str]:
    """The unresolved text of ``key`` in ``cfg`` (an interpolation), or None."""
    if cfg is None:
        return None
    parent, _, leaf = key.rpartition(".")
    try:
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, (DictConfig, ListConfig)):
            value = node._get_node(int(leaf) if isinstance(node, ListConfig) else leaf)._value()
            return value if isinstance(value, str) else None
    except Exception:  # noqa: BLE001 - a key path this cannot follow: no text shown
        return None
    return None


def _valid_keys(err: BaseException, message: str, parent: str, last_cfg: Any) -> list[str]:
    """The keys the schema allows where an unknown key was found."""
    schema = getattr(err, "object_type", None)
    if not dataclasses.is_dataclass(schema):
        name = re.search(r"object_type=(\w+)", message) or re.search(r"not in '(\w+)'", message)
        schema = _schemas().get(name.group(1)) if name else None
    if dataclasses.is_dataclass(schema):
        return sorted(f.name for f in dataclasses.fields(schema))
    return _keys_at(parent, last_cfg)


def _keys_at(parent: str, last_cfg: Any) -> list[str]:
    """Keys that exist at ``parent`` in the last composed (or base) config."""
    cfg = last_cfg if last_cfg is not None else OmegaConf.structured(Config)
    try:
        node = OmegaConf.select(cfg, parent) if parent else cfg
        return sorted(str(k) for k in node.keys())
    except Exception:  # noqa: BLE001 - a missing or non-dict parent: no listing
        return []
