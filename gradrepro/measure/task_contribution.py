"""The task contribution (``probe.task_contribution``): on a logged step of an objective with
more than one loss term (``LossOutput.terms``), the gradient norm each term alone sends to each
parameter, so that a term that stops reaching a module is seen apart from the total (the
probe computes the norms: ``probe/extras.py``; this keeps the step's graph for them)."""

from __future__ import annotations

from typing import Any

from gradrepro.measure.base import Measurement, measurement


@measurement
class TaskContribution(Measurement):
    name = "task_contribution"
    switch = "probe.task_contribution=true"
    columns = ("contrib_*",)  # contrib_<term>: the norm that term alone sends to each parameter

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return bool(cfg.probe.task_contribution)

    def keeps_graph(self, p: Any, out: Any) -> bool:
        return len(out.terms) > 1

    def after_backward(self, p: Any, out: Any) -> None:
        if len(out.terms) > 1:
            p.contribution(out.terms)
