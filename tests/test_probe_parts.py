"""The probe's modules talk through public interfaces: no module of gradrepro/probe/ reads
another object's private members (``x._name`` where ``x`` is not ``self`` or ``cls``, nor an
imported outside library such as ``torch._foreach_norm``), none imports a private name of
another, and no class there runs over 250 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "gradrepro" / "probe"
MAX_CLASS_LINES = 250


def _outside_modules(tree: ast.Module) -> set:
    """Names bound by an import from a library that is not gradrepro (``import torch``,
    ``from torch import nn``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if not alias.name.startswith("gradrepro")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("gradrepro"):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_reaches(source: str) -> list:
    """(line, text) of each private member read through another object, or private name
    imported from another gradrepro module."""
    tree = ast.parse(source)
    outside = _outside_modules(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(root, ast.Name) and root.id in outside:
                continue  # torch._foreach_norm, torch.distributed._tensor: outside libraries
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradrepro"):
            found += [(node.lineno, f"from {node.module} import {a.name}")
                      for a in node.names if a.name.startswith("_")]
    return found


def test_the_checker_finds_a_private_member_read_through_another_object():
    snippet = ("import torch\nfrom gradrepro.probe.blocks import _hidden\n"
               "class A:\n    def f(self, probe):\n        self._ok = torch._foreach_norm\n"
               "        probe._start(); probe.buffers._windows.release()\n")
    assert [line for line, _ in private_reaches(snippet)] == [2, 6, 6]


def test_no_probe_module_reaches_into_another_objects_private_members():
    found = {path.name: private_reaches(path.read_text()) for path in sorted(PROBE.glob("*.py"))}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_no_probe_class_runs_over_250_lines():
    long = {}
    for path in sorted(PROBE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.name}:{node.name}"] = lines
    assert long == {}
