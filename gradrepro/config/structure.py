"""The shape of a composed config, before its values are checked: keys its schema does not
declare (``+optim.lrr=0.1`` would be silently ignored) and lists of names or numbers that
hold lists instead (``train.freeze=[[a]]``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, List

from omegaconf import DictConfig, ListConfig, OmegaConf

from gradrepro.errors import UserError


def undeclared_keys(cfg: Any, prefix: str = "") -> list[tuple]:
    """(key, valid keys) for every key that its schema does not declare.

    Hydra's ``+key=value`` adds a key even to a typed (structured) node; such a key would be
    silently ignored by the code, so a misspelt ``+optim.lrr=0.1`` is caught here instead.
    Free-form nodes (``paper``, a check's ``params``) accept any key.
    """
    found = []
    if isinstance(cfg, DictConfig):
        schema = OmegaConf.get_type(cfg)
        if dataclasses.is_dataclass(schema):
            declared = {f.name for f in dataclasses.fields(schema)}
            found += [(f"{prefix}{k}", sorted(declared)) for k in cfg if k not in declared]
        for k in cfg:
            if not OmegaConf.is_missing(cfg, k) and not OmegaConf.is_interpolation(cfg, k):
                found += undeclared_keys(cfg[k], f"{prefix}{k}.")
    elif isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            if not OmegaConf.is_missing(cfg, i) and not OmegaConf.is_interpolation(cfg, i):
                found += undeclared_keys(cfg[i], f"{prefix[:-1]}[{i}].")
    return found


def check_flat_lists(cfg: Any, prefix: str = "") -> None:
    """A list the schema types as names or numbers (``train.freeze``, ``model.widths``) must
    not hold lists or mappings: the code would read ``[[a]]`` as one odd name."""
    if isinstance(cfg, ListConfig):
        for i in range(len(cfg)):
            if not OmegaConf.is_missing(cfg, i) and not OmegaConf.is_interpolation(cfg, i):
                check_flat_lists(cfg[i], f"{prefix[:-1]}[{i}].")
        return
    if not isinstance(cfg, DictConfig):
        return
    schema = OmegaConf.get_type(cfg)
    hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    for key in cfg:
        if OmegaConf.is_missing(cfg, key) or OmegaConf.is_interpolation(cfg, key):
            continue
        value, hint = cfg[key], hints.get(str(key))
        args = typing.get_args(hint)
        if (isinstance(value, ListConfig) and typing.get_origin(hint) in (list, List) and args
                and args[0] in (str, int, float, bool)):
            for i, item in enumerate(value):
                if isinstance(item, (ListConfig, DictConfig)):
                    raise UserError(f"{prefix}{key}[{i}]={OmegaConf.to_container(item)!r}: {prefix}{key} is a "
                                    f"list of {args[0].__name__} values, not of lists; e.g. {prefix}{key}=[a,b]")
        check_flat_lists(value, f"{prefix}{key}.")
