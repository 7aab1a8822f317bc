"""The objective interface: what the shared runner calls on every step and evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    loss: torch.Tensor  # the scalar that is differentiated
    # Named parts whose sum is ``loss``; with more than one, the probe records the gradient
    # norm each part alone sends to each parameter (task contribution).
    terms: Dict[str, torch.Tensor] = field(default_factory=dict)
    # Detached statistics logged beside the loss on logged steps (e.g. z_std).
    scalars: Dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def knn_accuracy(
    bank: torch.Tensor, bank_y: torch.Tensor, query: torch.Tensor, query_y: torch.Tensor, k: int
) -> float:
    """Cosine k-NN accuracy (majority vote weighted by similarity) of ``query`` against ``bank``."""
    bank = F.normalize(bank.float(), dim=1)
    query = F.normalize(query.float(), dim=1)
    k = min(k, len(bank))
    num_classes = int(max(bank_y.max(), query_y.max())) + 1
    correct = 0
    for start in range(0, len(query), 1024):
        sim = query[start : start + 1024] @ bank.T  # QxB
        top_sim, top_idx = sim.topk(k, dim=1)
        votes = torch.zeros(len(top_idx), num_classes, device=bank.device)
        votes.scatter_add_(1, bank_y[top_idx], top_sim.clamp_min(0) + 1e-6)
        correct += (votes.argmax(1) == query_y[start : start + 1024]).sum().item()
    return correct / len(query)


@torch.no_grad()
def features(net: torch.nn.Module, x: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    return torch.cat([net(x[i : i + batch]) for i in range(0, len(x), batch)])
