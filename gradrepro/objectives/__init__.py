"""Objective choices: each turns a model into the trained network (``wrap``), computes the
loss of a batch (``__call__``) and its held-out metrics (``held_out_metrics``), and declares the scalars it
records (``TRAIN_SCALARS`` on logged steps, ``EVAL_SCALARS`` at evaluations), so that a
signature's metric names are checked before training."""

from __future__ import annotations

from typing import Any

from gradrepro.objectives.base import ACCUMULATE_NORMS, LossOutput, loss_items, micro_batch_weights
from gradrepro.objectives.classification import Classification, ClassificationConfig
from gradrepro.objectives.dense_classification import DenseClassification, DenseClassificationConfig
from gradrepro.objectives.missing_grad import MissingGrad, MissingGradObjectiveConfig
from gradrepro.objectives.next_token import NextToken, NextTokenConfig
from gradrepro.objectives.simsiam import SimSiam, SimSiamConfig

# objective=NAME -> (its config schema, the class built from that config): the one registry.
OBJECTIVES = {
    "classification": (ClassificationConfig, Classification),
    "simsiam": (SimSiamConfig, SimSiam),
    "missing_grad": (MissingGradObjectiveConfig, MissingGrad),
    "next_token": (NextTokenConfig, NextToken),
    "dense_classification": (DenseClassificationConfig, DenseClassification),
}

__all__ = ["ACCUMULATE_NORMS", "LossOutput", "OBJECTIVES", "build_objective", "loss_items", "micro_batch_weights"]


def build_objective(cfg: Any) -> Any:
    return OBJECTIVES[cfg.name][1](cfg)
