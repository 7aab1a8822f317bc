"""Objective choices: each turns a model into the trained network (``wrap``), computes the
loss of a batch (``__call__``) and evaluates (``evaluate``)."""

from __future__ import annotations

from typing import Any

from gradrepro.objectives.base import LossOutput
from gradrepro.objectives.classification import Classification, ClassificationConfig
from gradrepro.objectives.missing_grad import MissingGrad, MissingGradObjectiveConfig
from gradrepro.objectives.simsiam import SimSiam, SimSiamConfig

OBJECTIVE_SCHEMAS = {"classification": ClassificationConfig, "simsiam": SimSiamConfig,
                     "missing_grad": MissingGradObjectiveConfig}
_BUILDERS = {"classification": Classification, "simsiam": SimSiam, "missing_grad": MissingGrad}

__all__ = ["LossOutput", "OBJECTIVE_SCHEMAS", "build_objective"]


def build_objective(cfg: Any) -> Any:
    return _BUILDERS[cfg.name](cfg)
