"""The init reference: the control's initialisation, measured in the same run on the same
first batch.

Some signatures compare a run with its control at init ("the first conv's weight-gradient
std under Xavier is at least 10^3 times below Kaiming's"). So that the verdict stays a pure
function of the run's own records, the run measures the reference itself: with
``init.reference: SCHEME`` it rebuilds the network from the RNG state its own weights were
drawn from (so the reference has exactly the weights the control's run gets for this seed),
initialises it with SCHEME, runs one forward/backward through the same probe on the batch the
run trains on first, and records the per-parameter statistics as constants
``reference/<module>.<param>/<column>``. Nothing of the run itself is touched: the reference
network is separate, and every RNG draw happens inside ``fork_rng``. (Reference *runs*, whole
runs of other experiments, are measure/reference_runs.py.)
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch

from gradrepro.measure.base import Measurement, measurement
from gradrepro.probe import Probe
from gradrepro.recipe.build import build_network
from gradrepro.records.run import reference_constant

# The per-parameter columns kept; with them the checks can compare any layer's signal.
COLUMNS = ("grad_norm", "grad_std", "grad_to_param", "grad_to_decay", "act_grad_std",
           "act_std", "pe_act_grad_var", "pe_grad_var")


@measurement
class InitReference(Measurement):
    """``init.reference: SCHEME``: the network under the control's init, one forward/backward
    on the run's first batch, before any step (see the module docstring)."""

    name = "init_reference"
    switch = "init.reference=SCHEME"
    constants = ("reference/loss", "reference/*")

    @staticmethod
    def enabled(cfg: Any) -> bool:
        return cfg.init.reference is not None

    def before_training(self) -> Dict[str, float]:
        c, t = self.ctx, self.ctx.training
        return measure_reference(c.cfg, t.data, t.objective, t.init_rng, c.generator, c.device)


def measure_reference(cfg: Any, data: Any, objective: Any, init_rng: torch.Tensor,
                      batch_generator: torch.Generator, device: torch.device) -> Dict[str, float]:
    """Constants of the reference network at init (see the module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(init_rng)
        net, facts = build_network(cfg, objective, scheme=cfg.init.reference)
    net.to(device).train()
    generator = torch.Generator().set_state(batch_generator.get_state())
    batch = data.sample(generator)
    probe = Probe(net, cfg.probe, total_steps=1, weight_decay=float(cfg.optim.weight_decay))
    with probe.step(0) as p:
        out = objective(net, batch)
        out.loss.backward()
        p.collect()
    columns = p.columns
    constants: Dict[str, float] = {"reference/loss": float(out.loss.detach())}
    # The reference's init std of each weight, beside the run's own (``init/<weight>/std``).
    constants.update({reference_constant(k.split("/")[1], "init_std"): v
                      for k, v in facts.items() if k.endswith("/std")})
    for i, (module, param) in enumerate(zip(columns["module"], columns["param"])):
        for column in COLUMNS:
            if column in columns and np.isfinite(columns[column][i]):
                constants[reference_constant(f"{module}.{param}", column)] = float(columns[column][i])
    return constants
