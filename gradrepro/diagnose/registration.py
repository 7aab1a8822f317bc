"""Registration and optimizer membership, by identity: every parameter tensor the model
registers, the ones it holds in plain attributes or containers without registering them,
the ones only the optimizer holds (a module replaced after the optimizer was built), and
orphaned leaves: a Parameter converted as it was assigned (``nn.Parameter(t).double()``,
``.to(dtype)``, ``.cuda()``) leaves a non-leaf copy on the module and a leaf that nothing
holds; the copy's graph leads to that leaf (``graph.leaves_of``)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradrepro.diagnose.graph import leaves_of

_MODULE_ATTRS = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping attributes
_SCAN_DEPTH = 3  # containers inside containers, this deep
_SCAN_ITEMS = 256  # items looked at per container


def scan_attributes(model: nn.Module, known: set) -> tuple[list[tuple[str, Any]], list[tuple[str, torch.Tensor]]]:
    """Plain attributes (and the lists, tuples, dicts in them) that hold modules with
    parameters ``known`` lacks or requires-grad tensors: (unregistered, non-leaf) by path."""
    unregistered: list[tuple[str, Any]] = []
    nonleaf: list[tuple[str, torch.Tensor]] = []
    visited: set = set()

    def visit(path: str, value: Any, depth: int) -> None:
        if isinstance(value, (torch.Tensor, nn.Module, list, tuple, dict)):
            if id(value) in visited:
                return
            visited.add(id(value))
        if isinstance(value, torch.Tensor):
            if id(value) not in known and value.requires_grad:
                (unregistered if value.is_leaf else nonleaf).append((path, value))
        elif isinstance(value, nn.Module):
            if any(id(p) not in known for p in value.parameters()):
                unregistered.append((path, value))
        elif isinstance(value, (list, tuple)) and depth < _SCAN_DEPTH:
            for i, item in enumerate(itertools.islice(value, _SCAN_ITEMS)):
                visit(f"{path}[{i}]", item, depth + 1)
        elif isinstance(value, dict) and depth < _SCAN_DEPTH:
            for key, item in itertools.islice(value.items(), _SCAN_ITEMS):
                visit(f"{path}[{key!r}]", item, depth + 1)

    for mod_name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_ATTRS:
                visit(f"{mod_name}.{key}" if mod_name else key, value, 0)
    return unregistered, nonleaf


def normalize_name(name: str) -> str:
    """``blocks[0].weight`` and ``blocks['a']`` as ``blocks.0.weight`` and ``blocks.a``."""
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", name)


@dataclass
class Row:
    name: str
    module: str
    tensor: torch.Tensor
    registered: bool
    aliases: str = ""
    orphan_of: str = ""  # for an orphaned leaf: the path of the non-leaf copy the module holds
    copy: torch.Tensor | None = None  # that copy


def parameter_rows(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[Row], list[tuple[str, Any]],
                                                                          list[tuple[str, torch.Tensor]]]:
    """Every parameter tensor: registered (probe order, tied weights once), unregistered ones
    found in plain attributes, orphaned leaves behind non-leaf copies, and tensors only the
    optimizer holds; with the scan's unregistered things and its non-leaf tensors (orphans' copies left out)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    rows, seen = [], set()
    for mod_name, module in model.named_modules():  # the probe's order: module by module
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied weight is one tensor: one row, its other names as aliases
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            rows.append(Row(full, mod_name or "<root>", p, True, ", ".join(n for n in names[id(p)] if n != full)))
    known = seen | {id(b) for b in model.buffers()}
    unregistered, nonleaf = scan_attributes(model, known)
    for path, thing in unregistered:
        if isinstance(thing, nn.Module):
            for p_name, p in thing.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    rows.append(Row(f"{path}.{p_name}", path, p, False))
        elif id(thing) not in seen:
            seen.add(id(thing))
            rows.append(Row(path, path.rpartition(".")[0] or "<root>", thing, False))
    orphaned = set()
    for path, copy in nonleaf:
        for leaf in orphan_leaves(copy, seen | {id(b) for b in model.buffers()}):
            seen.add(id(leaf))
            orphaned.add(path)
            rows.append(Row(f"{path} (leaf)", path.rpartition(".")[0] or "<root>", leaf, False, orphan_of=path,
                            copy=copy))
    nonleaf = [(path, t) for path, t in nonleaf if path not in orphaned]
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in seen:
                seen.add(id(p))
                rows.append(Row(f"param_groups.{gi}.params.{pi}", "<optimizer only>", p, False))
    return rows, unregistered, nonleaf


def orphan_leaves(copy: torch.Tensor, known: set) -> list[torch.Tensor]:
    """The leaves behind a non-leaf tensor held in a plain attribute that nothing registers: a
    Parameter (``nn.Parameter(...)`` converted on assignment), or the one leaf of a tensor computed
    from a single leaf. A cached intermediate computed from registered weights (and perhaps an
    input) has none."""
    every = leaves_of([copy])
    return [t for i, t in every.items() if i not in known and (isinstance(t, nn.Parameter) or len(every) == 1)]


def optimizer_members(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, dict]]:
    """id(tensor) -> (param group index, param group), for every tensor the optimizer holds."""
    members: dict[int, tuple[int, dict]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            members[id(p)] = (gi, group)
    return members
