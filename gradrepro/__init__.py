"""gradrepro: rerunnable, checkable reproductions of gradient-signal failures in PyTorch.

``gradrepro.record(model, optimizer, "runs/mine")`` records a user's own training loop and
``gradrepro.lightning.Record`` does it inside Lightning; both are imported on first use, so
``import gradrepro`` stays light.
"""

import importlib

__version__ = "0.1.0"

_LAZY = ("record", "lightning", "diagnose")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"gradrepro.{name}")
    raise AttributeError(f"module 'gradrepro' has no attribute {name!r}")
