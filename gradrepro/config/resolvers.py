"""OmegaConf resolvers the configs use.

``${calc:...}`` writes a threshold as the paper states it ("0.2 / sqrt(d)", "1 / K + 0.15"):
a small arithmetic language, parsed with ``ast`` and evaluated node by node (no ``eval``).
``${run_subdir:...}`` names a sweep job's folder by what changed (Hydra 1.3 docs,
"Customizing working directory pattern"), the seed last.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from omegaconf import OmegaConf

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}
_FUNCS = {"sqrt": math.sqrt, "log": math.log, "log2": math.log2, "exp": math.exp}


def calc(expression: str) -> float:
    """Evaluate a small arithmetic expression (numbers, + - * / **, sqrt, log, log2, exp)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and len(node.args) == 1
        ):
            return _FUNCS[node.func.id](ev(node.args[0]))
        raise ValueError(f"unsupported expression in calc: {expression!r}")

    value = float(ev(ast.parse(str(expression), mode="eval")))
    # Integral results stay ints so they can fill int fields (layer widths, dimensions).
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def run_subdir(override_dirname: str, seed: Any) -> str:
    """A sweep job's folder: what changed (Hydra's override_dirname, seed excluded), then the seed."""
    return f"{override_dirname}/seed={seed}" if override_dirname else f"seed={seed}"


def register_resolvers() -> None:
    """Register ``calc`` and ``run_subdir`` with OmegaConf (idempotent)."""
    for name, fn in (("calc", calc), ("run_subdir", run_subdir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
