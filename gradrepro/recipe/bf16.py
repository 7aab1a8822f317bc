"""Pure-bf16 training: bf16 parameters, and the rule that writes each optimizer update into them.

Zamirai et al. 2020, "Revisiting BFloat16 Training" (arXiv 2010.06192), abstract: on 16-bit units
that round to nearest, "nearest rounding for model weight updates often cancels small updates",
which costs accuracy; stochastic rounding or Kahan summation of the update recovers it. bf16 keeps
8 significant bits, so the weights next to w are 2^(floor(log2|w|) - 7) apart and an update smaller
than half that gap, 2^(floor(log2|w|) - 8), rounds back to w.

``precision.mode=bf16`` casts the network to bf16 (its input is cast at the entrance, so the
forward and backward run in bf16) and ``precision.bf16_update`` says how an update is written:

- ``nearest``: the optimizer's step is computed in fp32 from the bf16 weight, gradient and state,
  and the new weight rounded to the nearest bf16 value (what a bf16 unit does). Nothing but the
  bf16 weights carries over, so an update below half an ulp is lost for good.
- ``stochastic``: the same step, the new weight rounded up or down at random with the probability
  that makes the rounding unbiased (E[round(x)] = x): the paper's fix.
- ``master``: an fp32 copy of every weight takes the step (and the optimizer state stays fp32);
  the bf16 weights are its rounding to nearest (Micikevicius et al. 2018, Sec. 3.1, "master
  weights").

Under ``nearest`` and ``stochastic`` the optimizer state is rounded to bf16 after each step: the
whole model is bf16 and only the weight update's rounding differs between the two.

On a step it is asked to (``watch()``), the rule keeps, per parameter, the intended update u
(the fp32 step) and what reached the weights that carry over (the bf16 ones, or the fp32 master):
how many entries have u != 0 and, of those with |u| < half an ulp of their weight, how many, the
sum of |u| and the sum of what arrived in u's direction. Nearest rounding delivers none of that
mass; stochastic rounding delivers all of it in expectation; master weights deliver it exactly.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

BF16_UPDATES = ("nearest", "stochastic", "master")
# Kept per parameter on a watched step: entries with a non-zero intended update; of those, the
# ones below half an ulp of their weight, the sum of their |update|, and the sum of what reached
# the carried-over weights in the update's direction.
UPDATE_STATS = ("bf16_update_nonzero", "bf16_update_small", "bf16_update_small_mass", "bf16_update_kept_mass")
_LOW_BITS = 1 << 16  # bf16 is fp32's upper 16 bits: the lower 16 are what rounding removes


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to a neighbouring bf16 value at random, up (away from zero) with
    probability (the dropped low 16 bits) / 2^16, so that E[result] = x; returned as fp32 holding
    bf16 values. Adding a uniform integer in [0, 2^16) to the bit pattern and clearing the low 16
    bits does exactly that for either sign (sign and magnitude are separate bits). NaN stays NaN."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = ((bits + noise) & -_LOW_BITS).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit in the last place of ``w`` (fp32): 2^(floor(log2|w|) - 8), from the
    exponent bits alone; 0 where w is 0 or subnormal (no update there is below it)."""
    exponent = w.contiguous().view(torch.int32) & 0x7F800000
    return exponent.view(torch.float32) * 2.0**-8


def _to_input_dtype(module: nn.Module, args: tuple):
    """Forward pre-hook of a bf16 network: its floating inputs enter as bf16."""
    return tuple(a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


class BF16Weights:
    """The network's weights in bf16 and the update rule ``rule`` (one of ``BF16_UPDATES``)."""

    def __init__(self, rule: str, net: nn.Module, seed: int) -> None:
        if rule not in BF16_UPDATES:
            raise ValueError(f"unknown precision.bf16_update {rule!r}; choose one of {', '.join(BF16_UPDATES)}")
        self.rule = rule
        self.params: List[nn.Parameter] = [p for p in net.parameters() if p.requires_grad]
        # The master copy is the fp32 weights the network was initialised with (master weights).
        self.master: Optional[List[torch.Tensor]] = (
            [p.detach().float().clone() for p in self.params] if rule == "master" else None)
        net.to(torch.bfloat16)
        net.register_forward_pre_hook(_to_input_dtype)
        first = self.params[0].device if self.params else torch.device("cpu")
        # Stochastic rounding draws from its own generator: the run's other draws are unchanged.
        self.generator = torch.Generator(device=first).manual_seed(seed)
        self._watching = False
        self.stats: Dict[int, torch.Tensor] = {}  # id(param) -> the UPDATE_STATS of the last watched step

    def watch(self) -> None:
        """Keep the update statistics of the next step (``columns`` reads them)."""
        self._watching = True
        self.stats.clear()

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step in fp32 on the weights' fp32 values, written back by the rule."""
        params = [p for p in self.params if p.grad is not None]
        if not params:
            optimizer.step()
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        work = ([self.master[index[id(p)]] for p in params] if self.master is not None
                else [p.detach().float() for p in params])  # exact: every bf16 value is an fp32 value
        before = [w.clone() for w in work] if self._watching else []
        stored = [(p.data, p.grad) for p in params]
        for p, w in zip(params, work):  # the optimizer steps fp32 tensors (its new state is fp32)
            p.data, p.grad = w, p.grad.float()
        try:
            optimizer.step()
        finally:
            for p, (data, grad) in zip(params, stored):
                p.grad = None  # a bf16 gradient cannot be set on the fp32 tensor
                p.data = data
                p.grad = grad
        if self.master is None:
            self._round_state(optimizer, params)
        for p, w in zip(params, work):
            # Into bf16: copy_ rounds to nearest; a stochastically rounded value is bf16 already.
            p.copy_(stochastic_round_to_bf16(w, self.generator) if self.rule == "stochastic" else w)
        if self._watching:
            self._keep_stats(params, work, before)
            self._watching = False

    def _round_state(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
        """Pure bf16: the optimizer's floating state (momentum, Adam's moments) rounded to bf16."""
        for p in params:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    value.copy_(value.to(torch.bfloat16))

    def _keep_stats(self, params: Sequence[nn.Parameter], work: Sequence[torch.Tensor],
                    before: Sequence[torch.Tensor]) -> None:
        for p, w, b in zip(params, work, before):
            intended = w - b
            # What carried over: the fp32 master itself, or the bf16 weights after the write.
            arrived = intended if self.master is not None else p.detach().float() - b
            small = (intended != 0) & (intended.abs() < half_ulp_bf16(b))
            self.stats[id(p)] = torch.stack([
                (intended != 0).sum().double(),
                small.sum().double(),
                torch.where(small, intended.abs(), 0.0).sum().double(),
                torch.where(small, arrived * torch.sign(intended), 0.0).sum().double(),
            ])

    def columns(self, params: Sequence[torch.Tensor]) -> Dict[str, np.ndarray]:
        """The last watched step's statistics as modules.parquet columns, one row per tensor in
        ``params`` (the probe's order); NaN for a tensor this rule did not step."""
        nan = torch.full((len(UPDATE_STATS),), float("nan"), dtype=torch.float64)
        rows = [self.stats.get(id(p), nan).cpu() for p in params]
        table = torch.stack(rows).numpy() if rows else np.zeros((0, len(UPDATE_STATS)))
        return {name: table[:, j] for j, name in enumerate(UPDATE_STATS)}
