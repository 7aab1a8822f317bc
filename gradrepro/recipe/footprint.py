"""What a run will hold in memory at least, known before anything is allocated: the network's
parameters with their gradients and optimizer state (counted on the meta device, where
tensors have shapes but no storage) and the data set's images, all float32. A config whose
lower bound exceeds the memory this machine has free is refused in one line, instead of the
process being killed for memory (or the machine slowing to a crawl) part-way through."""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradrepro.errors import UserError
from gradrepro.recipe.build import build_untrained

FLOAT32 = 4  # bytes
# Copies of each parameter a step holds: the weights, their gradient, and the optimizer's
# state (SGD with momentum: one buffer; Adam and AdamW: two moment estimates).
_COPIES = {"sgd": 3, "adam": 4, "adamw": 4}


def available_memory() -> Optional[int]:
    """Bytes of memory free for a new process (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parameter_count(cfg: Any) -> Optional[int]:
    """Parameters of the network ``cfg`` builds, counted on the meta device (no storage)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):  # no random number is used up
            return sum(p.numel() for p in build_untrained(cfg).net.parameters())
    except Exception:  # noqa: BLE001 - a model the meta device cannot build: the real build says why
        return None


def footprint(cfg: Any) -> Optional[int]:
    """A lower bound of the bytes a run holds: parameters (x their copies) and the images."""
    params = parameter_count(cfg)
    if params is None:
        return None
    images = (cfg.data.n_train + cfg.data.n_test) * cfg.data.channels * cfg.data.image_size ** 2
    return FLOAT32 * (params * _COPIES.get(cfg.optim.name, 4) + images)


def check_footprint(cfg: Any) -> None:
    """UserError if the run's lower bound exceeds the memory free now."""
    need, free = footprint(cfg), available_memory()
    if need is not None and free is not None and need > free:
        params = parameter_count(cfg)
        raise UserError(
            f"this config needs at least {need / 2**30:.1f} GiB ({params:,} parameters with gradients and "
            f"optimizer state, and {cfg.data.n_train + cfg.data.n_test:,} images of "
            f"{cfg.data.channels}x{cfg.data.image_size}x{cfg.data.image_size}), more than the "
            f"{free / 2**30:.1f} GiB free here; lower data.image_size, data.n_train or the model's widths")
