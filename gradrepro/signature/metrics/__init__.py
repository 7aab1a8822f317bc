"""Derived signature metrics, one module per family. Importing this package registers them all
(``registry.METRICS``), so every metric name is known before a run starts."""

from gradrepro.signature.metrics import (
    accumulation,
    bf16,
    clipping,
    curves,
    layers,
    missing_grad,
    modes,
    precision,
    runs,
)

__all__ = ["accumulation", "bf16", "clipping", "curves", "layers", "missing_grad", "modes", "precision", "runs"]
