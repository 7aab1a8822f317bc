"""Data choices: ``data=digits`` (scikit-learn, shipped), ``data=patterns`` (synthetic views),
``data=cifar10`` (a local folder)."""

from __future__ import annotations

from typing import Any

from gradrepro.data.base import Batch, DataBase, ImageData
from gradrepro.data.cifar10 import Cifar10, Cifar10Config
from gradrepro.data.digits import Digits, DigitsConfig
from gradrepro.data.patterns import Patterns, PatternsConfig

# data=NAME -> (its config schema, the class built from that config): the one registry.
DATA = {
    "digits": (DigitsConfig, Digits),
    "patterns": (PatternsConfig, Patterns),
    "cifar10": (Cifar10Config, Cifar10),
}

__all__ = ["Batch", "DataBase", "ImageData", "DATA", "build_data"]


def build_data(cfg: Any, seed: int) -> ImageData:
    return DATA[cfg.name][1](cfg, seed)
