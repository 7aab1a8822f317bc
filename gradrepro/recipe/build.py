"""One build of what a run trains: data, objective, network (model + init), frozen modules,
optimizer and schedule, mode policy, precision and probe.

The same functions serve the run (``build_training``), the preflight that checks a config
before any run starts (``build_untrained``: no data, on the CPU) and the init reference
(``build_network`` with another scheme), so the three cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from gradrepro.data import ImageData, build_data
from gradrepro.diagnose.placement import DeviceMismatch, device_mismatch_at_first_forward
from gradrepro.errors import UserError, first_line, quiet_unless_it_fails
from gradrepro.models import build_model
from gradrepro.objectives import build_objective
from gradrepro.probe import Probe
from gradrepro.recipe.forward_check import check_forward
from gradrepro.recipe.init import initialize
from gradrepro.recipe.mode_policy import hold_eval
from gradrepro.recipe.module_prefixes import check_prefixes
from gradrepro.recipe.optim import build_optimizer, freeze
from gradrepro.recipe.precision import Precision
from gradrepro.recipe.sharding import attach_probe, rank_data, shard_model


def build_network(cfg: Any, objective: Any, scheme: str | None = None) -> Tuple[nn.Module, Dict[str, float]]:
    """The model wrapped by the objective (SimSiam's heads), initialised by ``init.scheme``
    (or ``scheme``) with ``init.std`` and ``init.mode``, and its shape facts as constants
    (``init/<weight>/fan_in|fan_out|std``; none under PyTorch's default init)."""
    net = objective.wrap(build_model(cfg.model))
    facts = initialize(net, scheme or cfg.init.scheme, cfg.init.std, cfg.init.mode)
    return net, facts


@dataclass
class Untrained:
    """The objective, the network and its optimizer, before any data or device."""

    objective: Any
    net: nn.Module
    frozen: List[str]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    # The torch RNG state the network's weights were drawn from (the init reference redraws them).
    init_rng: torch.Tensor
    # The network's shape facts, recorded as run constants (recipe/init.py, ``initialize``).
    shape_facts: Dict[str, float] = field(default_factory=dict)


def build_untrained(cfg: Any) -> Untrained:
    objective = build_objective(cfg.objective)
    init_rng = torch.get_rng_state()
    net, facts = build_network(cfg, objective)
    shard_model(net, "cuda" if cfg.device == "cuda" else "cpu")  # FSDP2 in a run of several processes
    check_prefixes(net, "train.freeze", list(cfg.train.freeze))
    check_prefixes(net, "train.eval_modules", list(cfg.train.eval_modules), parameters=False)
    check_prefixes(net, "optim.fixed_lr", list(cfg.optim.fixed_lr))
    frozen = freeze(net, list(cfg.train.freeze))
    optimizer, scheduler = build_optimizer(net, cfg.optim, cfg.train.steps)
    return Untrained(objective, net, frozen, optimizer, scheduler, init_rng, facts)


@dataclass
class Training(Untrained):
    """Everything the loop needs, on its device."""

    data: ImageData = None  # type: ignore[assignment]
    precision: Precision = None  # type: ignore[assignment]
    probe: Probe = None  # type: ignore[assignment]
    held: List[str] = field(default_factory=list)  # modules held in eval mode (train.eval_modules)
    device_mismatch: Optional[DeviceMismatch] = None  # the first forward failed on unmoved tensors


def build_training(cfg: Any, device: torch.device) -> Training:
    """Build the run; a value only the building code rejects (a size, a missing table entry,
    a model and data that do not fit) is a UserError of one line."""
    with quiet_unless_it_fails():  # a refusal is one line, not torch's warnings first
        what = "data"
        try:
            data = build_data(cfg.data, cfg.seed).to(device)
            check_data_shape(data, cfg.data)
            what = "model, objective or optimizer"
            parts = build_untrained(cfg)
            parts.net.to(device).train()
            held = hold_eval(parts.net, list(cfg.train.eval_modules))
            # A network may act once its optimizer exists (a case that replaces a module after the
            # optimizer was built; an evaluation that diagnoses one step of that optimizer).
            if callable(getattr(parts.net, "on_optimizer", None)):
                parts.net.on_optimizer(parts.optimizer)
            precision = Precision(cfg.precision, device)
            precision.prepare(parts.net, cfg.seed)  # bf16 weights in precision.mode=bf16
            probe = Probe(parts.net, cfg.probe, cfg.train.steps, weight_decay=float(cfg.optim.weight_decay))
            probe.bf16 = precision.bf16 is not None  # frac_bf16_update_lost: what bf16 weights round away
            attach_probe(probe)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, MemoryError) as exc:
            raise UserError(f"the {what} cannot be built from this config: {first_line(exc)}") from None
        # Says itself what went wrong (a device, dtype or shape mismatch, ...): its own UserError.
        # A model whose unregistered tensors stayed behind fails here on a GPU: a result, recorded.
        mismatch = device_mismatch_at_first_forward(
            parts.net, lambda: check_forward(parts.objective, parts.net, data, cfg.seed))
    # In several processes, each trains on its slice of every batch.
    return Training(**vars(parts), data=rank_data(data), precision=precision, probe=probe, held=held,
                    device_mismatch=mismatch)


def check_data_shape(data: ImageData, cfg_data: Any) -> None:
    """Models are built from ``data.channels`` and ``data.image_size``; a data choice whose
    images differ (those keys overridden for data that fixes them) is bad input, not a crash
    at the first forward pass."""
    got = tuple(data.x_train.shape[1:])
    said = (cfg_data.channels, cfg_data.image_size, cfg_data.image_size)
    if got != said:
        raise UserError(
            f"data={cfg_data.name} gives images of {'x'.join(map(str, got))} but "
            f"data.channels / data.image_size say {'x'.join(map(str, said))}; leave them at "
            f"the data choice's values")
