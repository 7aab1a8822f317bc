"""Model choices. Each model exposes ``out_dim``; with ``num_classes: 0`` it is a feature
extractor that an objective puts heads on (SimSiam's projector and predictor)."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradrepro.models.convnet import ConvNet, ConvNetConfig
from gradrepro.models.missing_grad import MissingGradCase, MissingGradConfig
from gradrepro.models.mlp import MLP, MLPConfig
from gradrepro.models.plainnet import PlainNet, PlainNetConfig
from gradrepro.models.resnet import ResNet18Cifar, ResNet18CifarConfig

MODEL_SCHEMAS = {"mlp": MLPConfig, "convnet": ConvNetConfig, "resnet18_cifar": ResNet18CifarConfig,
                 "missing_grad": MissingGradConfig, "plainnet": PlainNetConfig}
_BUILDERS = {"mlp": MLP, "convnet": ConvNet, "resnet18_cifar": ResNet18Cifar,
             "missing_grad": MissingGradCase, "plainnet": PlainNet}


def build_model(cfg: Any) -> nn.Module:
    return _BUILDERS[cfg.name](cfg)
