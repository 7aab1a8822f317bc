"""Data choices: ``data=digits`` (scikit-learn, shipped), ``data=patterns`` (synthetic views),
``data=cifar10`` (a local folder), ``data=token_sequences`` (synthetic padded sequences with
next-token targets)."""

from __future__ import annotations

from typing import Any

from gradrepro.data.base import Batch, DataBase, ImageData, split_batch
from gradrepro.data.cifar10 import Cifar10, Cifar10Config
from gradrepro.data.digits import Digits, DigitsConfig
from gradrepro.data.patterns import Patterns, PatternsConfig
from gradrepro.data.token_sequences import TokenSequences, TokenSequencesConfig

# data=NAME -> (its config schema, the class built from that config): the one registry.
DATA = {
    "digits": (DigitsConfig, Digits),
    "patterns": (PatternsConfig, Patterns),
    "cifar10": (Cifar10Config, Cifar10),
    "token_sequences": (TokenSequencesConfig, TokenSequences),
}

__all__ = ["Batch", "DataBase", "ImageData", "DATA", "build_data", "split_batch"]


def build_data(cfg: Any, seed: int) -> ImageData:
    return DATA[cfg.name][1](cfg, seed)
