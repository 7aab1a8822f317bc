"""``train.freeze`` and ``train.eval_modules`` name modules (or parameters) by prefix. A name
that matches nothing would leave the network as it is and run the failure's setting under the
control's name (or the reverse), so each must name a module or parameter of the model."""

from __future__ import annotations

import difflib
from typing import Sequence

from torch import nn

from gradrepro.errors import UserError

_LISTED = 25  # names listed in the message; the rest are counted


def check_prefixes(net: nn.Module, key: str, prefixes: Sequence[str], parameters: bool = True) -> None:
    """UserError naming ``key`` and the valid names if a prefix names no module (or parameter)."""
    modules = [name for name, _ in net.named_modules() if name]
    names = set(modules) | ({name for name, _ in net.named_parameters()} if parameters else set())
    for prefix in prefixes:
        prefix = str(prefix)
        if prefix in names:
            continue
        close = difflib.get_close_matches(prefix, sorted(names), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        more = f", ... ({len(modules) - _LISTED} more)" if len(modules) > _LISTED else ""
        shown = ", ".join(modules[:_LISTED]) + more
        raise UserError(f"{key}: {prefix!r} names no module{' or parameter' if parameters else ''} of this "
                        f"model{hint}; its modules: {shown or 'none'}")
