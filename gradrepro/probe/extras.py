"""The probe's statistics that only some experiments configure: per loss term, the gradient
norm each term alone sends (``probe.task_contribution``); per-example variances
(``probe.per_example``); activation-gradient histograms (``probe.act_grad_hist``); and over
the running-sum window, what the optimizer stepped with (``probe.running_sum_steps``). Their
cost grows with the tensors they cover; the default logged step runs none of them."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from gradrepro.probe.kernels import list_norms


def contribution_norms(params: Sequence[torch.Tensor], term: torch.Tensor) -> tuple:
    """The tensors one loss term reaches and their ``kernels.list_norms`` rows (None: it
    reaches none). Runs after the main backward, which kept the graph (``retain_graph``)."""
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    grads = torch.autograd.grad(term, [params[i] for i in trainable], retain_graph=True,
                                allow_unused=True)
    present = [(i, g) for i, g in zip(trainable, grads) if g is not None]
    if not present:
        return [], None
    return [i for i, _ in present], list_norms([g.float() for _, g in present])


def optional_parts(modules: Sequence[str], per_example: Dict[str, torch.Tensor],
                   hist: Dict[str, torch.Tensor], contrib: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    """The configured statistics as named tensors for the one transfer, a row per parameter
    row of ``modules.parquet`` (NaN for a module without a value this step)."""
    parts: Dict[str, torch.Tensor] = {}
    if per_example:
        nan2 = torch.full_like(next(iter(per_example.values())), math.nan)
        parts["per_example"] = torch.stack([per_example.get(m, nan2) for m in modules])
    if hist:
        nan_h = torch.full_like(next(iter(hist.values())), math.nan)
        parts["hist"] = torch.stack([hist.get(m, nan_h) for m in modules])
    for name, (_, rows) in contrib.items():
        if rows is not None:
            parts[f"contrib_{name}"] = rows
    return parts


def step_residuals(stepped: Sequence[torch.Tensor], have: Sequence[int], fresh: Sequence[torch.Tensor],
                   running: List[torch.Tensor], lr: float) -> torch.Tensor:
    """2 x n: relative distance of (update / lr) from the fresh gradient and from the
    running sum, per tensor; NaN for tensors without a gradient. ``stepped``: per tensor,
    (before - after) = lr x the gradient the optimizer stepped with."""
    n = len(stepped)
    out = torch.full((2, n), float("nan"), dtype=torch.float64, device=stepped[0].device)
    for j, i in enumerate(have):
        step = stepped[i].double() / lr
        for row, target in ((0, fresh[j].double()), (1, running[i])):
            out[row, i] = torch.linalg.vector_norm(step - target) / torch.linalg.vector_norm(target)
    return out
