"""The measurement protocol: what an experiment measures besides the probe's columns.

The loop never names a quantity (the shape of Cockpit's quantities, Schneider et al. 2021,
``cockpit/cockpit.py``): it asks each active measurement, at fixed moments of a run, for what
it does there, and a measurement says which config switches it on and which names it records.

    before training   after the evaluation at step 0:         ``before_training() -> constants``
    a logged step     before the forward pass:                 ``before_forward(p)``
                      does the backward keep the graph?        ``keeps_graph(p, out) -> bool``
                      after the backward:                      ``after_backward(p, out)``
                      after the probe collected the gradients: ``after_collect(p, batch)``
                      the step's modules.parquet columns:      ``step_columns(p) -> columns``
    after training    after the records are written:           ``after_training(completed) -> constants``

Unlogged steps call nothing. A measurement is one class in one module of ``gradrepro.measure``,
registered with ``@measurement``; ``gradrepro.measure`` imports every one, so validation knows
before any run which names each active measurement will record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import torch


@dataclass
class RunContext:
    """What a measurement may use: the config, the built training (``recipe.build.Training``:
    net, objective, data, probe, precision, optimizer, frozen and eval-mode modules), the device,
    the generator the batches are drawn from, and the run's folder and overrides. ``run_experiment``
    and ``compose`` are the pipeline's own, handed down so that a measurement can make whole
    runs of another experiment without importing the layers above it."""

    cfg: Any
    training: Any
    device: torch.device
    generator: torch.Generator
    run_dir: Path
    overrides: Sequence[str] = ()
    run_experiment: Optional[Callable[..., Dict[str, Any]]] = None
    compose: Optional[Callable[[Sequence[str]], Any]] = None
    stopped: Callable[[], bool] = field(default=lambda: False)


class Measurement:
    """One measurement (see the module docstring). Subclasses set ``name``, ``switch`` (the
    config that turns it on, said when a check reads a name it records but it is off),
    ``constants`` and ``columns`` (the names it records, fnmatch patterns allowed), and
    override ``enabled`` and the moments they act at."""

    name: ClassVar[str]
    switch: ClassVar[str]
    constants: ClassVar[Tuple[str, ...]] = ()
    columns: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    @staticmethod
    def enabled(cfg: Any) -> bool:
        raise NotImplementedError

    def before_training(self) -> Dict[str, float]:
        return {}

    def before_forward(self, p: Any) -> None:
        pass

    def keeps_graph(self, p: Any, out: Any) -> bool:
        return False

    def after_backward(self, p: Any, out: Any) -> None:
        pass

    def after_collect(self, p: Any, batch: Any) -> None:
        pass

    def step_columns(self, p: Any) -> Dict[str, np.ndarray]:
        return {}

    def after_training(self, completed: bool) -> Dict[str, float]:
        return {}

    # What a measurement adds to the run besides constants (reference runs: their records for
    # the verdict, their essentials for the summary, and why one failed).
    def reference_records(self) -> Dict[str, Any]:
        return {}

    def summary_fields(self) -> Dict[str, Any]:
        return {}

    def failure(self) -> Optional[str]:
        return None


MEASUREMENTS: Dict[str, Type[Measurement]] = {}


def measurement(cls: Type[Measurement]) -> Type[Measurement]:
    """Register a measurement class under its ``name``; registration order is the order the
    loop asks them in."""
    if cls.name in MEASUREMENTS and MEASUREMENTS[cls.name] is not cls:
        raise ValueError(f"two measurements are named {cls.name!r}")
    MEASUREMENTS[cls.name] = cls
    return cls


def active_classes(cfg: Any) -> List[Type[Measurement]]:
    """The measurements this config switches on, in registration order."""
    return [cls for cls in MEASUREMENTS.values() if cls.enabled(cfg)]


def start_measurements(ctx: RunContext) -> List[Measurement]:
    """An instance of each measurement the run's config switches on."""
    return [cls(ctx) for cls in active_classes(ctx.cfg)]


def produced_by(cfg: Any) -> Tuple[set, set]:
    """The constant and column names (and patterns) the active measurements record."""
    constants, columns = set(), set()
    for cls in active_classes(cfg):
        constants |= set(cls.constants)
        columns |= set(cls.columns)
    return constants, columns
