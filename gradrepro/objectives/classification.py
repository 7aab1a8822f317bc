"""Cross-entropy classification, evaluated by held-out accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.objectives.base import LossOutput, features, in_eval_mode


@dataclass
class ClassificationConfig:
    name: str = "classification"


class Classification:
    TRAIN_SCALARS = ("train_acc",)
    EVAL_SCALARS = ("test_acc",)

    def __init__(self, cfg: ClassificationConfig) -> None:
        self.cfg = cfg

    def wrap(self, model: nn.Module) -> nn.Module:
        """The network to train: the model itself, which must output logits."""
        if getattr(model, "out_dim", 0) < 2:
            raise ValueError("classification needs a model with num_classes > 1")
        return model

    def __call__(self, net: nn.Module, batch: Batch) -> LossOutput:
        logits = net(batch.x)  # NxK
        loss = F.cross_entropy(logits.float(), batch.y)
        acc = (logits.detach().argmax(1) == batch.y).float().mean()
        return LossOutput(loss, scalars={"train_acc": acc})

    @torch.no_grad()
    def held_out_metrics(self, net: nn.Module, data: ImageData, knn_k: int = 20) -> Dict[str, float]:
        _, _, x_test, y_test = data.eval_sets()
        with in_eval_mode(net):
            logits = features(net, x_test)
        return {"test_acc": (logits.argmax(1) == y_test).float().mean().item()}
