"""Model choices. Each model exposes ``out_dim``; with ``num_classes: 0`` it is a feature
extractor that an objective puts heads on (SimSiam's projector and predictor)."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradrepro.models.causal_rows import CausalRows, CausalRowsConfig
from gradrepro.models.convnet import ConvNet, ConvNetConfig
from gradrepro.models.missing_grad import MissingGradCase, MissingGradConfig
from gradrepro.models.mlp import MLP, MLPConfig
from gradrepro.models.plainnet import PlainNet, PlainNetConfig
from gradrepro.models.resnet import ResNet18Cifar, ResNet18CifarConfig

# model=NAME -> (its config schema, the class built from that config): the one registry.
MODELS = {
    "mlp": (MLPConfig, MLP),
    "convnet": (ConvNetConfig, ConvNet),
    "resnet18_cifar": (ResNet18CifarConfig, ResNet18Cifar),
    "missing_grad": (MissingGradConfig, MissingGradCase),
    "plainnet": (PlainNetConfig, PlainNet),
    "causal_rows": (CausalRowsConfig, CausalRows),
}


def build_model(cfg: Any) -> nn.Module:
    return MODELS[cfg.name][1](cfg)
