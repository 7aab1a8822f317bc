"""The mode policy: which modules train in eval mode (``train.eval_modules``), and keeping
every module's own mode across a block that switches them.

``module.eval()`` switches a module's function (BatchNorm: running instead of batch
statistics; dropout: off); it does not switch off autograd.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == pre or name.startswith(pre + ".") for pre in prefixes)


def hold_eval(net: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """Put the modules under ``prefixes`` (and their children) in eval mode; return their names.

    ``net.train()`` undoes this (it sets every child), so call it again after anything that
    switches the whole network, as the runner does after each evaluation."""
    held = []
    for name, module in net.named_modules():
        if name and _under(name, prefixes):
            module.eval()
            held.append(name)
    return held


@contextlib.contextmanager
def modes_kept(net: nn.Module) -> Iterator[None]:
    """Restore every module's own training flag on exit (``net.train(flag)`` would not)."""
    flags = [(m, m.training) for m in net.modules()]
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
