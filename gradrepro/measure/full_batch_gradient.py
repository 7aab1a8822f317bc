"""The full-batch gradient beside an accumulated one (``train.accumulate`` > 1): on each logged
step, after the micro-batches' backwards and before the optimizer step (the same weights, the same
batch), the objective's loss on the whole batch is differentiated once, and per parameter:

- ``accum_grad_rel_err``: ||accumulated - full|| / ||full||, the accumulated gradient being what
  ``.grad`` holds, the one the optimizer steps with;
- ``accum_grad_rounding_bound``: how large that relative difference can be from rounding alone,
  for a ``nn.Linear``'s weight and bias (NaN for other tensors). Both gradients are the same sum
  over the batch's R rows of per-row terms d_r x_r^T (d_r: the gradient at the layer's output,
  x_r: its input), grouped differently. Each computation errs by at most gamma_n = n u / (1 - n u)
  times A = sum_r |d_r| |x_r|^T, entrywise (Higham 2002, Accuracy and Stability of Numerical
  Algorithms, Sec. 3.1, Eq. 3.5), where u is the unit roundoff (2^-24 in fp32) and n the length
  of the longest chain of operations behind an entry: the R-term reduction plus the computation of
  d_r and x_r, which for these small models is shorter than R, so n <= 2R. The two differ by at
  most 2 gamma_2R A, so by at most 2 gamma_2R ||A|| / ||full|| relative to the full gradient.

Normalised by the batch's total number of loss items, accumulation is the full batch's sum in
another grouping: the difference is rounding, within the bound. Averaged per micro-batch, the
micro-batches of fewer tokens weigh more: the difference is arithmetic, above any rounding
(``signature/metrics/accumulation.py`` compares the two columns).

What it leaves alone: no ``.grad`` is written (``torch.autograd.grad``), buffers are restored and
the RNG is forked, so training continues exactly as without it."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import torch
from torch import nn

from gradrepro.measure.base import Measurement, measurement

COLUMNS = ("accum_grad_rel_err", "accum_grad_rounding_bound")


@measurement
class FullBatchGradient(Measurement):
    name = "full_batch_gradient"
    switch = "train.accumulate=N (N > 1)"
    columns = COLUMNS

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return int(cfg.train.accumulate) > 1

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.values: Dict[int, tuple] = {}  # id(param) -> (rel_err, bound)

    def after_collect(self, p: Any, batch: Any) -> None:
        t = self.ctx.training
        self.values = compare_with_full_batch(t.objective, t.net, batch, t.precision.autocast)

    def step_columns(self, p: Any) -> Dict[str, np.ndarray]:
        params = self.ctx.training.probe.params
        table = np.array([self.values.get(id(q), (np.nan, np.nan)) for q in params], dtype=float).reshape(-1, 2)
        self.values = {}
        return {name: table[:, j] for j, name in enumerate(COLUMNS)}


def _linear_terms(net: nn.Module) -> tuple[List[Any], Dict[nn.Module, list]]:
    """Forward hooks that keep each Linear's input and, in the backward, its output gradient."""
    kept: Dict[nn.Module, list] = {}

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if module in kept or not (torch.is_tensor(output) and output.requires_grad):
            return  # a module called twice: its first call
        kept[module] = [inputs[0].detach()]
        output.register_hook(lambda grad: kept[module].append(grad.detach()))

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, nn.Linear)]
    return handles, kept


def _rounding_bound(inputs: torch.Tensor, out_grad: torch.Tensor, full: torch.Tensor, is_bias: bool) -> float:
    """2 gamma_2R ||A|| / ||full|| (module docstring) for a Linear's weight or bias."""
    x = inputs.reshape(-1, inputs.shape[-1]).abs().double()
    d = out_grad.reshape(-1, out_grad.shape[-1]).abs().double()
    rows = x.shape[0]
    u = torch.finfo(full.dtype).eps / 2
    gamma = 2 * rows * u / (1 - 2 * rows * u)
    absolute = d.sum(0) if is_bias else d.T @ x
    norm = float(full.double().norm())
    return 2 * gamma * float(absolute.norm()) / norm if norm > 0 else np.nan


def compare_with_full_batch(objective: Any, net: nn.Module, batch: Any,
                            autocast: Callable[[], Any]) -> Dict[int, tuple]:
    """Per parameter with a gradient: (||.grad - full|| / ||full||, the rounding bound or NaN)."""
    params = [q for q in net.parameters() if q.requires_grad and q.grad is not None]
    if not params:
        return {}
    handles, kept = _linear_terms(net)
    saved = [b.detach().clone() for b in net.buffers()]
    devices = list(range(torch.cuda.device_count())) if params[0].is_cuda else []
    try:
        with torch.random.fork_rng(devices=devices):
            with autocast():
                loss = objective(net, batch).loss
            full = torch.autograd.grad(loss.float(), params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, copy in zip(net.buffers(), saved):
                buffer.copy_(copy)
    owner = {id(m.weight): (m, False) for m in kept} | {id(m.bias): (m, True) for m in kept if m.bias is not None}
    out: Dict[int, tuple] = {}
    for q, g in zip(params, full):
        if g is None:
            continue
        norm = float(g.double().norm())
        rel = float((q.grad.double() - g.double()).norm()) / norm if norm > 0 else np.nan
        bound = np.nan
        if id(q) in owner and len(kept[owner[id(q)][0]]) == 2:
            module, is_bias = owner[id(q)]
            bound = _rounding_bound(*kept[module], g, is_bias)
        out[id(q)] = (rel, bound)
    return out
