"""The one record type: what a run recorded, in memory (the runner, before writing) or read
back from a run folder (``records.reader.read_run(path).records()``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

import numpy as np
import pandas as pd

# The columns of scalars.parquet every run records on its logged steps (the training loop);
# objectives add their own (``TRAIN_SCALARS``, ``EVAL_SCALARS``).
RUN_SCALARS = ("step", "loss", "lr", "loss_scale", "skipped_steps", "scale_growths", "scale_backoffs",
               "grad_norm", "fresh_grad_norm")

# The constants a run records in summary.json besides the objective's ``*_init`` values: the
# held-out size, and the network's shape facts (each weight's fans and init std, recipe/init.py)
# where an init scheme drew the weights.
RUN_CONSTANTS = ("n_test", "init/*")


@dataclass
class RunRecords:
    scalars: pd.DataFrame  # scalars.parquet: one row per logged step
    modules: pd.DataFrame  # modules.parquet: one row per (logged step, parameter tensor)
    constants: Dict[str, float] = field(default_factory=dict)  # summary.json "constants"
    # Records of the reference runs this run made (config ``references``), by name.
    references: Dict[str, "RunRecords"] = field(default_factory=dict)


def reference_constant(param: str, column: str) -> str:
    """The constant under which the init reference (measure/init_reference.py) records one
    parameter's statistic: ``reference/<module>.<param>/<column>``."""
    return f"reference/{param}/{column}"


def parameter_names(modules: Mapping[str, Any]) -> np.ndarray:
    """Each ``modules.parquet`` row's tensor as ``named_parameters()`` names it: ``module.param``
    (a parameter of the root module by its own name); ``modules``: the frame, or its columns."""
    return np.array([str(p) if m == "<root>" else f"{m}.{p}" for m, p in zip(modules["module"], modules["param"])],
                    dtype=object)
