"""A reference measured at init in the same run: the control's init on the same first batch.

Some signatures compare a run with its control at init ("the first conv's weight-gradient
std under Xavier is at least 10^3 times below Kaiming's"). So that the verdict stays a pure
function of the run's own records, the run measures the reference itself: with
``init.reference: SCHEME`` it rebuilds the network from the RNG state its own weights were
drawn from (so the reference has exactly the weights the control's run gets for this seed),
initialises it with SCHEME, runs one forward/backward through the same probe on the batch the
run trains on first, and records the per-parameter statistics as constants
``reference/<module>.<param>/<column>``. Nothing of the run itself is touched: the reference
network is separate, and every RNG draw happens inside ``fork_rng``.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch

from gradrepro.init import initialize
from gradrepro.models import build_model
from gradrepro.probe import Probe

# The per-parameter columns kept; with them the checks can compare any layer's signal.
COLUMNS = ("grad_norm", "grad_std", "grad_to_param", "grad_to_decay", "act_grad_std",
           "act_std", "pe_act_grad_var", "pe_grad_var")


def constant_name(param: str, column: str) -> str:
    return f"reference/{param}/{column}"


def measure_reference(cfg: Any, data: Any, objective: Any, init_rng: torch.Tensor,
                      batch_generator: torch.Generator, device: torch.device) -> Dict[str, float]:
    """Constants of the reference network at init (see the module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(init_rng)
        net = objective.wrap(build_model(cfg.model))
        initialize(net, cfg.init.reference, cfg.init.std, cfg.init.mode)
    net.to(device).train()
    generator = torch.Generator().set_state(batch_generator.get_state())
    batch = data.sample(generator)
    probe = Probe(net, cfg.probe, total_steps=1)
    probe.weight_decay = float(cfg.optim.weight_decay)
    probe.arm()
    out = objective(net, batch)
    out.loss.backward()
    probe.collect()
    probe.disarm()
    columns = probe.after_step(0)
    constants: Dict[str, float] = {"reference/loss": float(out.loss.detach())}
    for i, (module, param) in enumerate(zip(columns["module"], columns["param"])):
        for column in COLUMNS:
            if column in columns and np.isfinite(columns[column][i]):
                constants[constant_name(f"{module}.{param}", column)] = float(columns[column][i])
    return constants
