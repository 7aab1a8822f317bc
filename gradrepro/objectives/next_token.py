"""Next-token prediction: a token-level cross-entropy, averaged over the tokens that have a
target (padding and each sequence's last token have none: ``data/token_sequences.py``), as a
causal language model's loss is. A batch's loss is a mean over its tokens, not its sequences, so
two batches of as many sequences hold different numbers of loss items (``items``): what gradient
accumulation must divide by (the gradient accumulation fix of the Hugging Face Transformers
maintainers, "Fixing Gradient Accumulation", 2024-10-16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from gradrepro.data import Batch, ImageData
from gradrepro.data.token_sequences import IGNORE, next_token_targets
from gradrepro.objectives.base import LossOutput, in_eval_mode


@dataclass
class NextTokenConfig:
    name: str = "next_token"


class NextToken:
    TRAIN_SCALARS = ("train_acc",)  # of the batch's target tokens
    EVAL_SCALARS = ("test_loss", "test_acc")  # per token of the held-out set

    def __init__(self, cfg: NextTokenConfig) -> None:
        self.cfg = cfg

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model itself, asked for logits at every row (``per_row``)."""
        if not hasattr(model, "per_row"):
            raise ValueError(f"objective=next_token needs a model with an output per row (model=causal_rows), "
                             f"not {type(model).__name__}")
        model.per_row = True
        return model

    @staticmethod
    def items(batch: Batch) -> int:
        """The loss items of ``batch``: its tokens with a target."""
        return int((next_token_targets(batch.x) != IGNORE).sum())

    def _token_losses(self, net: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        targets = next_token_targets(batch.x).reshape(-1)  # NL
        logits = net(batch.x)  # NxLxK
        flat = logits.float().reshape(-1, logits.shape[-1])
        losses = F.cross_entropy(flat, targets, ignore_index=IGNORE, reduction="none")  # NL, 0 where ignored
        real = targets != IGNORE
        return losses, real, (flat.detach().argmax(1) == targets) & real

    def __call__(self, net: nn.Module, batch: Batch) -> LossOutput:
        losses, real, correct = self._token_losses(net, batch)
        count = real.sum().clamp(min=1)
        return LossOutput(losses.sum() / count, scalars={"train_acc": correct.sum() / count})

    @torch.no_grad()
    def held_out_metrics(self, net: nn.Module, data: ImageData, knn_k: int = 20) -> Dict[str, float]:
        _, _, x_test, y_test = data.eval_sets()
        with in_eval_mode(net):
            total, right, count = 0.0, 0.0, 0
            for start in range(0, len(x_test), 1024):
                chunk = Batch(x_test[start:start + 1024], y_test[start:start + 1024])
                losses, real, correct = self._token_losses(net, chunk)
                total, right, count = total + float(losses.sum()), right + float(correct.sum()), count + int(real.sum())
        return {"test_loss": total / max(count, 1), "test_acc": right / max(count, 1)}
