"""Tiny broken models, one per cause of a missing gradient, each with its repaired variant.

Source: the PyTorch editorial guide "Diagnose missing gradients and unchanged parameters"
("unregistered layers, an optimizer
referencing an old Parameter, intentional freezing, a detached expression, reconstruction with
torch.tensor, a no-grad context, unused branches, or inspection of a non-leaf tensor whose
gradient was not retained"). Every case is the same small classifier

    x (Nx1x8x8) -> flatten -> encoder: Linear(in, hidden) -> tanh -> [case] -> head: Linear(hidden, K)

with one defect at ``[case]``; ``repaired: true`` builds the fix a user would make. tanh (not
ReLU) keeps the loss smooth, so finite differences agree with autograd to float64 precision.
Causes that live in the training loop rather than the model (``frozen``: ``train.freeze``;
``forgotten_zero_grad``: ``train.zero_grad``) use ``cause: healthy`` and the runner's knob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

CAUSES = ("healthy", "unregistered_list", "tensor_attribute", "stale_optimizer", "detached", "no_grad",
          "tensor_rebuild", "unused_branch", "nonleaf_grad", "eval_mode")


@dataclass
class MissingGradConfig:
    name: str = "missing_grad"
    cause: str = "healthy"  # one of CAUSES
    repaired: bool = False  # build the fixed variant of the same case
    in_dim: int = "${calc:'${data.channels} * ${data.image_size} ** 2'}"  # type: ignore[assignment]
    hidden: int = 16
    num_classes: int = "${data.num_classes}"  # type: ignore[assignment]


class MissingGradCase(nn.Module):
    def __init__(self, cfg: MissingGradConfig) -> None:
        super().__init__()
        if cfg.cause not in CAUSES:
            raise ValueError(f"model.cause={cfg.cause!r} is not one of {', '.join(CAUSES)}")
        self.cause, self.repaired = cfg.cause, cfg.repaired
        h, k = int(cfg.hidden), int(cfg.num_classes)
        self.encoder = nn.Linear(int(cfg.in_dim), h)
        self.head = nn.Linear(h, k)
        self.out_dim = k
        if self.cause == "unregistered_list":  # a plain list hides the blocks from the optimizer
            blocks = [nn.Linear(h, h)]
            self.blocks = nn.ModuleList(blocks) if self.repaired else blocks
        elif self.cause == "tensor_attribute":  # a tensor with requires_grad is not a Parameter
            self.scale = nn.Parameter(torch.ones(h)) if self.repaired else torch.ones(h, requires_grad=True)
        elif self.cause == "unused_branch":  # an auxiliary head whose output the loss never uses
            self.aux = nn.Linear(h, k)
        elif self.cause == "eval_mode":  # layers whose behaviour depends on train/eval
            self.norm = nn.BatchNorm1d(h)
            self.drop = nn.Dropout(0.1)

    def on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The runner's hook, called once after it builds the optimizer. The objective's
        evaluation diagnoses this optimizer; the stale-optimizer case replaces its head now."""
        object.__setattr__(self, "optimizer", optimizer)  # a plain reference, not module state
        if self.cause == "stale_optimizer" and not self.repaired:
            old = self.head
            self.head = nn.Linear(old.in_features, old.out_features).to(old.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x.flatten(1)))  # NxH
        if self.cause == "detached" and not self.repaired:
            h = h.detach()
        elif self.cause == "no_grad" and not self.repaired:
            with torch.no_grad():
                h = torch.tanh(self.encoder(x.flatten(1)))
        elif self.cause == "tensor_rebuild" and not self.repaired:
            h = torch.tensor(h.tolist(), dtype=h.dtype, device=h.device)  # values kept, graph lost
        elif self.cause == "unregistered_list":
            for block in self.blocks:
                h = torch.tanh(block(h))
        elif self.cause == "tensor_attribute":
            h = h * self.scale
        elif self.cause == "nonleaf_grad":
            self.features = h  # an intermediate a user later inspects: its .grad is None by design
        elif self.cause == "eval_mode":
            h = self.drop(self.norm(h))
        out = self.head(h)  # NxK
        if self.cause == "unused_branch":
            aux = self.aux(h)
            if self.repaired:  # the repair: the loss uses the branch
                out = out + aux
        return out
