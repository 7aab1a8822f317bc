"""OmegaConf resolvers the configs use.

``${calc:...}`` writes a threshold as the paper states it ("0.2 / sqrt(d)", "1 / K + 0.15"):
a small arithmetic language, parsed with ``ast`` and evaluated node by node (no ``eval``).
``${run_subdir:...}`` names a sweep job's folder by what changed (Hydra 1.3 docs,
"Customizing working directory pattern"), the seed last. ``${cores_up_to:N}``: an
experiment's measured thread count, capped by the cores a small machine has.
"""

from __future__ import annotations

import ast
import math
import operator
import os
from typing import Any

from omegaconf import OmegaConf

from gradrepro.config.help_groups import help_groups
from gradrepro.config.short_help import overrides_text

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def _sqrt(x: float) -> float:
    if x < 0:
        raise ValueError(f"sqrt({x:g}) is undefined (a negative number)")
    return math.sqrt(x)


def _log(base_log):
    def log(x: float) -> float:
        if x <= 0:
            raise ValueError(f"{base_log.__name__}({x:g}) is undefined (a number <= 0)")
        return base_log(x)
    return log


_FUNCS = {"sqrt": _sqrt, "log": _log(math.log), "log2": _log(math.log2), "exp": math.exp}


def calc(expression: str) -> float:
    """Evaluate a small arithmetic expression (numbers, + - * / **, sqrt, log, log2, exp).

    Every number is a float while the expression is evaluated, so ``9**9**9`` overflows at
    once instead of computing a 370-million-digit integer; a failure is a ValueError that
    says which part could not be computed."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return float(node.value)
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
        raise ValueError("only numbers, + - * / **, sqrt, log, log2 and exp are supported")

    shown = repr(str(expression)) if len(str(expression)) <= 80 else repr(str(expression)[:77] + "...")
    try:
        value = float(ev(ast.parse(str(expression), mode="eval")))
    except ZeroDivisionError:
        raise ValueError(f"calc: {shown} cannot be computed: division by zero") from None
    except (OverflowError, SyntaxError, ValueError, RecursionError) as exc:
        reason = ("the result is beyond the float range" if isinstance(exc, OverflowError)
                  else str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        raise ValueError(f"calc: {shown} cannot be computed: {reason}") from None
    if not math.isfinite(value):
        raise ValueError(f"calc: {shown} is not a finite number ({value})")
    # Integral results stay ints so they can fill int fields (layer widths, dimensions).
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cores_up_to(n: Any) -> int:
    """``${cores_up_to:N}``: N CPU threads, or fewer on a machine that has fewer cores."""
    return max(1, min(int(n), usable_cores()))


def run_subdir(override_dirname: str, seed: Any) -> str:
    """A sweep job's folder: what changed (Hydra's override_dirname, seed excluded), then the seed."""
    return f"{override_dirname}/seed={seed}" if override_dirname else f"seed={seed}"


def register_resolvers() -> None:
    """Register ``calc``, ``run_subdir``, ``cores_up_to``, ``help_groups`` and
    ``help_overrides`` with OmegaConf (idempotent)."""
    for name, fn in (("calc", calc), ("run_subdir", run_subdir), ("cores_up_to", cores_up_to),
                     ("help_groups", help_groups), ("help_overrides", overrides_text)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
