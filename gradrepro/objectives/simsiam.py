"""SimSiam (Chen & He, CVPR 2021, arXiv 2011.10566): projector, predictor and the
symmetric negative-cosine loss. The stop-gradient is one flag, so its ablation is one override.

Official code: facebookresearch/simsiam, simsiam/builder.py (``z1.detach(), z2.detach()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.objectives.base import LossOutput, features, in_eval_mode, knn_accuracy, linear_probe_accuracy


@dataclass
class SimSiamConfig:
    name: str = "simsiam"
    stop_gradient: bool = True  # Sec. 4.1, Fig. 2: the one difference
    predictor: bool = True  # Table 1a: without a predictor SimSiam collapses
    dim: int = 64  # d, the projector's output (2048 in the paper)
    pred_dim: int = 16  # predictor bottleneck, d/4 (512 in the paper)
    # BN in the heads (Table 3): "all" is the paper's default (every projector fc, including
    # its output, and the predictor's bottleneck fc: 68.1%); "hidden" puts BN on hidden fcs
    # only (67.4%); "none" removes it (34.6%).
    head_bn: str = "all"
    projector_layers: int = 2  # 3 on ImageNet, 2 on CIFAR (App. D)


def _fc_bn_relu(d_in: int, d_out: int, bn: bool) -> list[nn.Module]:
    return [nn.Linear(d_in, d_out, bias=not bn), *([nn.BatchNorm1d(d_out)] if bn else []), nn.ReLU()]


class SimSiamNet(nn.Module):
    """backbone -> projector (z) -> predictor (p); see Sec. 3 of the paper."""

    def __init__(self, backbone: nn.Module, cfg: SimSiamConfig) -> None:
        super().__init__()
        if cfg.head_bn not in ("all", "hidden", "none"):
            raise ValueError(f"objective.head_bn must be all, hidden or none, not {cfg.head_bn!r}")
        self.backbone = backbone
        hidden_bn = cfg.head_bn != "none"
        layers: list[nn.Module] = []
        d_in = backbone.out_dim
        for _ in range(cfg.projector_layers - 1):
            layers += _fc_bn_relu(d_in, cfg.dim, hidden_bn)
            d_in = cfg.dim
        layers.append(nn.Linear(d_in, cfg.dim, bias=cfg.head_bn != "all"))
        if cfg.head_bn == "all":
            layers.append(nn.BatchNorm1d(cfg.dim, affine=False))  # as builder.py's last BN
        self.projector = nn.Sequential(*layers)
        self.predictor = (
            nn.Sequential(*_fc_bn_relu(cfg.dim, cfg.pred_dim, hidden_bn), nn.Linear(cfg.pred_dim, cfg.dim))
            if cfg.predictor
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.projector(self.backbone(x))  # NxD
        return z, self.predictor(z)  # NxD, NxD

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the projector's output before its output BN, z, p): the forward pass, with the
        pre-BN output kept. Without an output BN (``head_bn`` hidden or none) it is z itself."""
        pre = self.backbone(x)
        for layer in self.projector[:-1]:
            pre = layer(pre)
        last = self.projector[-1]
        if isinstance(last, nn.BatchNorm1d):
            z = last(pre)  # NxD
        else:
            pre = z = last(pre)
        return pre, z, self.predictor(z)


def negative_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return -F.cosine_similarity(p.float(), z.float(), dim=1).mean()


def output_std(z: torch.Tensor) -> torch.Tensor:
    """Mean per-channel std of z/||z|| over the batch: ~1/sqrt(d) when healthy, 0 collapsed."""
    return F.normalize(z.detach().float(), dim=1).std(dim=0).mean()


def channel_variance(pre: torch.Tensor) -> torch.Tensor:
    """Per-channel variance over the batch (biased, as BN's train-mode normalisation uses) of
    the projector's output before its output BN: BN divides by sqrt(var + eps), so z can
    shrink in train mode only where this variance approaches BN's eps (1e-5)."""
    return pre.detach().float().var(dim=0, unbiased=False)


class SimSiam:
    # z_std, p_std: the collapse statistic of z and of p; zpre_var (median over channels) and
    # zpre_var_min: the projector's output variance before its output BN, against BN's eps.
    TRAIN_SCALARS = ("z_std", "p_std", "zpre_var", "zpre_var_min")
    # linear_acc: the paper's measure (linear evaluation of the frozen backbone); knn_acc: a
    # monitor beside it.
    EVAL_SCALARS = ("linear_acc", "knn_acc")

    def __init__(self, cfg: SimSiamConfig) -> None:
        self.cfg = cfg

    def wrap(self, model: nn.Module) -> nn.Module:
        return SimSiamNet(model, self.cfg)

    def __call__(self, net: nn.Module, batch: Batch) -> LossOutput:
        if batch.x2 is None:
            raise ValueError("SimSiam needs two views: set data.views=true")
        pre1, z1, p1 = net.heads(batch.x)
        z2, p2 = net(batch.x2)
        if self.cfg.stop_gradient:
            z1, z2 = z1.detach(), z2.detach()
        terms = {"p1_z2": negative_cosine(p1, z2) / 2, "p2_z1": negative_cosine(p2, z1) / 2}
        return LossOutput(
            terms["p1_z2"] + terms["p2_z1"],
            terms=terms,
            scalars={"z_std": output_std(z1), "p_std": output_std(p1),
                     "zpre_var": channel_variance(pre1).median(), "zpre_var_min": channel_variance(pre1).min()},
        )

    @torch.no_grad()
    def held_out_metrics(self, net: nn.Module, data: ImageData, knn_k: int = 20) -> Dict[str, float]:
        """Of the frozen backbone's features, in eval mode: the accuracy of a linear classifier
        fitted on the bank and scored on the held-out set (the paper's linear evaluation), and
        the cosine k-NN accuracy of the held-out set against the bank (a monitor)."""
        bank, bank_y, query, query_y = data.eval_sets()
        with in_eval_mode(net):
            bank_h, query_h = features(net.backbone, bank), features(net.backbone, query)
        return {
            "linear_acc": linear_probe_accuracy(bank_h, bank_y, query_h, query_y),
            "knn_acc": knn_accuracy(bank_h, bank_y, query_h, query_y, k=knn_k),
        }
