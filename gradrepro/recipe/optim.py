"""Optimizer and learning-rate schedule from ``optim``; frozen modules from ``train.freeze``."""

from __future__ import annotations

import math
from typing import List

import torch
from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")


def freeze(net: nn.Module, prefixes: List[str]) -> List[str]:
    """Set requires_grad=False on parameters under the given module prefixes; returns their names."""
    frozen = []
    for name, p in net.named_parameters():
        if any(name == pre or name.startswith(pre + ".") for pre in prefixes):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def build_optimizer(net: nn.Module, cfg, steps: int):
    params = [p for p in net.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    elif cfg.name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"unknown optim.name {cfg.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.schedule == "cosine":  # SimSiam: lr x 0.5 (1 + cos(pi t / T))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / max(steps, 1)))
        )
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    return opt, sched
