"""Dense per-location classification: a detector-like loss whose structure makes activation
gradients small, as SSD's are (Micikevicius et al. 2018, Sec. 3.2, Fig. 3).

Every sample has ``locations`` outputs (SSD300 has 8,732 default boxes per image: 38^2 x 4 +
19^2 x 6 + 10^2 x 6 + 5^2 x 6 + 3^2 x 4 + 1^2 x 4, Liu et al. 2016, Sec. 2.2 and 3), each a
K-way classification of the sample from its own feature vector, and the loss is the mean
cross-entropy over the batch's B x A outputs. Each logit's gradient is then (p - y) / (B A),
and each location's features receive only their own outputs' share of it: no sum over the
other locations lifts them. Only the shared trunk, below the locations, sums them back up.

The head (``DenseHead``): the trunk's features h (BxD) -> per-location features
``W h + e_l`` (BxFxA; e_l a learned offset of location l, standing in for the different
image patch each SSD default box sees) -> ReLU -> (``location_layers - 1`` more per-location
maps) -> a classifier shared by the locations (BxKxA), as SSD's classifier is one convolution
over each source map. The sample's prediction is the class with the highest mean logit over
its locations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.objectives.base import LossOutput, in_eval_mode
from gradrepro.objectives.classification import Classification

SSD300_DEFAULT_BOXES = 38**2 * 4 + 19**2 * 6 + 10**2 * 6 + 5**2 * 6 + 3**2 * 4 + 1**2 * 4  # 8,732


@dataclass
class DenseClassificationConfig:
    name: str = "dense_classification"
    locations: int = SSD300_DEFAULT_BOXES  # A: outputs per sample (SSD300's default boxes)
    width: int = 8  # F: each location's features
    location_layers: int = 1  # per-location feature maps below the classifier: 1, as SSD (one conv on a source map)
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]
    eval_chunk: int = 32  # held-out samples per forward (a chunk holds chunk x A x F values)


class LocationFeatures(nn.Module):
    """BxD -> BxFxA: a linear map of the sample's features plus a learned offset per location.
    One leaf module, so the fp16 emulation rounds its output gradient (every location's).
    Locations are the last dimension: the per-location maps and the loss then run over
    contiguous rows of A values (several times faster on a CPU than A rows of F)."""

    def __init__(self, in_dim: int, width: int, locations: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, in_dim))
        self.bias = nn.Parameter(torch.empty(width, locations))  # e_l, one column per location
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default
        nn.init.normal_(self.bias)  # locations differ by about one unit of W h

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # BxD -> BxFxA
        out = (h @ self.weight.T)[:, :, None]
        return out + self.bias[None].to(out.dtype)  # under autocast: stays fp16 (see PerLocation)


class PerLocation(nn.Module):
    """BxIxA -> BxOxA: one linear map applied at every location (SSD's heads are convolutions:
    the same weights at every location), initialised as ``nn.Linear``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        layer = nn.Linear(in_dim, out_dim)
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(self.weight, a)
        # The bias in the product's dtype: under fp16 autocast the sum stays fp16, as a
        # convolution's output with its bias does (SSD's classifier), instead of promoting the
        # logits to fp32 and hiding the fp16 gradient inside the module. In fp32 a no-op.
        return out + self.bias[None, :, None].to(out.dtype)


class DenseHead(nn.Module):
    def __init__(self, trunk: nn.Module, cfg: DenseClassificationConfig) -> None:
        super().__init__()
        self.trunk = trunk
        layers: list[nn.Module] = [LocationFeatures(trunk.out_dim, cfg.width, cfg.locations), nn.ReLU()]
        for _ in range(cfg.location_layers - 1):
            layers += [PerLocation(cfg.width, cfg.width), nn.ReLU()]
        layers.append(PerLocation(cfg.width, cfg.num_classes))
        self.head = nn.Sequential(*layers)
        self.out_dim = cfg.num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # -> BxKxA
        h = self.trunk(x)  # BxD
        return self.head(h.reshape(len(h), -1))


class DenseClassification(Classification):
    """Classification's scalars, each sample's class at every one of its locations."""

    cfg: DenseClassificationConfig

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the trunk under the dense head: its output (``out_dim`` values per sample)
        is the features every location reads."""
        if int(getattr(model, "out_dim", 0)) < 1:
            raise ValueError("objective=dense_classification needs a model with out_dim features, "
                             f"not {type(model).__name__}")
        if int(self.cfg.num_classes) < 2 or min(self.cfg.locations, self.cfg.width, self.cfg.location_layers) < 1:
            raise ValueError("objective=dense_classification needs num_classes > 1 and locations, width and "
                             "location_layers >= 1")
        return DenseHead(model, self.cfg)

    def __call__(self, net: nn.Module, batch: Batch) -> LossOutput:
        logits = net(batch.x)  # BxKxA
        b, _, a = logits.shape
        targets = batch.y[:, None].expand(b, a)  # every location of a sample has the sample's class
        loss = F.cross_entropy(logits.float(), targets)  # the mean over the B x A outputs
        acc = (logits.detach().float().mean(2).argmax(1) == batch.y).float().mean()
        return LossOutput(loss, scalars={"train_acc": acc})

    @torch.no_grad()
    def held_out_metrics(self, net: nn.Module, data: ImageData, knn_k: int = 20) -> Dict[str, float]:
        _, _, x_test, y_test = data.eval_sets()
        with in_eval_mode(net):
            right = 0
            for start in range(0, len(x_test), self.cfg.eval_chunk):
                logits = net(x_test[start:start + self.cfg.eval_chunk]).float().mean(2)  # BxK
                right += int((logits.argmax(1) == y_test[start:start + self.cfg.eval_chunk]).sum())
        return {"test_acc": right / max(len(x_test), 1)}
