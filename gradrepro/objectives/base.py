"""The objective interface: what the shared runner calls on every step and evaluation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Sequence, Tuple

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


# train.accumulate_norm: how a micro-batch's loss (a mean over its items) is weighted.
ACCUMULATE_NORMS = ("per_micro_batch_mean", "total_tokens")


def loss_items(objective: Any, batch: Any) -> int:
    """How many items ``objective``'s loss on ``batch`` averages over: the objective's own count
    (``items``: a token-level loss counts its target tokens), else the batch's examples."""
    items = getattr(objective, "items", None)
    return int(items(batch)) if callable(items) else len(batch.x)


def micro_batch_weights(objective: Any, parts: Sequence[Any], norm: str) -> Tuple[List[float], List[float]]:
    """(the weight of each micro-batch's mean loss before its backward, its share of the batch's
    items). ``per_micro_batch_mean``: 1 / parts, so the accumulated gradient is the mean of the
    micro-batch means; ``total_tokens``: its items / all items, so the accumulated gradient is the
    batch's mean over its items, the full batch's gradient (the two agree only when every
    micro-batch holds as many items: Hugging Face, "Fixing Gradient Accumulation", 2024-10-16)."""
    counts = [loss_items(objective, part) for part in parts]
    total = sum(counts)
    shares = [n / total if total else 1.0 / len(parts) for n in counts]
    if norm == "per_micro_batch_mean":
        return [1.0 / len(parts)] * len(parts), shares
    if norm == "total_tokens":
        return shares, shares
    raise ValueError(f"unknown train.accumulate_norm {norm!r}; choose one of {', '.join(ACCUMULATE_NORMS)}")


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


def linear_probe_accuracy(
    bank: torch.Tensor, bank_y: torch.Tensor, query: torch.Tensor, query_y: torch.Tensor,
    steps: int = 100, weight_decay: float = 1e-4,
) -> float:
    """Accuracy on ``query`` of a linear classifier fitted on frozen ``bank`` features: the
    linear evaluation of SimSiam (Chen & He 2021, Sec. 4 and App. A: a linear classifier on the
    frozen backbone's features). Multinomial logistic regression on features standardised with
    the bank's mean and std, full batch, L-BFGS from zero weights (deterministic, draws no random
    numbers, so it leaves the run's random streams as they were)."""
    bank, query = bank.detach().float(), query.detach().float()
    mean, std = bank.mean(0), bank.std(0).clamp_min(1e-6)
    bank, query = (bank - mean) / std, (query - mean) / std
    num_classes = int(max(bank_y.max(), query_y.max())) + 1
    weight = torch.zeros(bank.shape[1], num_classes, device=bank.device, requires_grad=True)
    bias = torch.zeros(num_classes, device=bank.device, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(bank @ weight + bias, bank_y) + weight_decay * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return ((query @ weight + bias).argmax(1) == query_y).float().mean().item()


@torch.no_grad()
@contextlib.contextmanager
def in_eval_mode(net: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``net`` in eval mode for a held-out evaluation, its training mode given back after."""
    was_training = net.training
    net.eval()
    try:
        yield net
    finally:
        net.train(was_training)


def features(net: torch.nn.Module, x: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    return torch.cat([net(x[i : i + batch]) for i in range(0, len(x), batch)])
