"""Optimizer and learning-rate schedule from ``optim``; frozen modules from ``train.freeze``."""

from __future__ import annotations

import math
from typing import List

import torch
from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")


def _under(name: str, prefixes: List[str]) -> bool:
    return any(name == pre or name.startswith(pre + ".") for pre in prefixes)


def freeze(net: nn.Module, prefixes: List[str]) -> List[str]:
    """Set requires_grad=False on parameters under the given module prefixes; returns their names."""
    frozen = []
    for name, p in net.named_parameters():
        if _under(name, prefixes):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def build_optimizer(net: nn.Module, cfg, steps: int):
    """The optimizer over the trainable parameters and its schedule. Parameters under a module
    named in ``cfg.fixed_lr`` form their own group whose lr the schedule leaves at ``cfg.lr``
    (SimSiam, Sec. 4.2 and Table 1c: the predictor's lr not decayed, 68.1 against 67.7)."""
    fixed_names = list(getattr(cfg, "fixed_lr", None) or [])
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    scheduled = [p for n, p in named if not _under(n, fixed_names)]
    fixed = [p for n, p in named if _under(n, fixed_names)]
    params = [{"params": scheduled}] + ([{"params": fixed}] if fixed else [])
    if cfg.name == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    elif cfg.name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"unknown optim.name {cfg.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.schedule == "cosine":  # SimSiam: lr x 0.5 (1 + cos(pi t / T))
        decay = lambda t: 0.5 * (1 + math.cos(math.pi * min(t, steps) / max(steps, 1)))  # noqa: E731
    else:
        decay = lambda t: 1.0  # noqa: E731
    lambdas = [decay] + ([lambda t: 1.0] if fixed else [])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
