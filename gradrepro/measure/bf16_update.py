"""What the bf16 update rule delivered (``precision.mode=bf16``): on each logged step, per
parameter, the entries whose intended update (the optimizer's fp32 step) is below half a bf16
unit in the last place of their weight, the sum of those updates' sizes, and the part of that sum
that reached the weights which carry over to the next step (``recipe/bf16.py`` keeps the counts;
this asks for them). Nearest rounding delivers none of it (Zamirai et al. 2020, abstract: "nearest
rounding for model weight updates often cancels small updates"), stochastic rounding all of it in
expectation, fp32 master weights all of it exactly; ``signature/metrics/bf16.py`` reads the share.

The probe's own ``frac_bf16_update_lost`` is the other half of the picture: per module, the
entries whose bf16 weight did not move at the step (under stochastic rounding a small update also
leaves its weight unmoved on most steps, and moves it a whole ulp on the others)."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from gradrepro.measure.base import Measurement, measurement
from gradrepro.recipe.bf16 import UPDATE_STATS


@measurement
class BF16UpdateMeasurement(Measurement):
    name = "bf16_update"
    switch = "precision.mode=bf16"
    columns = UPDATE_STATS

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return cfg.precision.mode == "bf16"

    def after_collect(self, p: Any, batch: Any) -> None:
        self.ctx.training.precision.bf16.watch()  # the coming optimizer step

    def step_columns(self, p: Any) -> Dict[str, np.ndarray]:
        t = self.ctx.training
        return t.precision.bf16.columns(t.probe.params)
