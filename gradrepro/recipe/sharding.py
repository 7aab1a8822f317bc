"""What a run of several processes trains with (``distributed.processes``; the processes are
started by ``train/distributed.py``): the model sharded over them with FSDP2, each process's
slice of every batch, and the probe's one collective per logged step.

FSDP2 (``fully_shard``) turns each parameter and its gradient into a DTensor sharded along its
first dimension: process r holds rows [r n / R, (r + 1) n / R) of a tensor of n rows. Every
process draws the same global batch from the same seeded generator and takes its own slice, and
FSDP2 averages the gradients over the processes, so the gradient is the global batch's, as in one
process. In a single process (no process group) every function here leaves things as they are.

``GRADREPRO_KILL_RANK_AT=RANK:STEP`` (a test hook) kills process RANK with SIGKILL when it draws
its batch for step STEP: a process lost mid-run.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

import torch
from torch import nn

from gradrepro.errors import UserError
from gradrepro.probe import ranks

KILL_ENV = "GRADREPRO_KILL_RANK_AT"


def rank_and_world() -> tuple:
    """(rank, processes) of the run's process group; (0, 1) without one."""
    return ranks.process_group() or (0, 1)


def _fully_shard():
    try:  # public since torch 2.6
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch 2.4 and 2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def shard_model(net: nn.Module, device_type: str = "cpu") -> nn.Module:
    """Shard ``net`` over the processes with FSDP2: each module that holds parameters itself,
    then the whole (the root's own parameters and its collectives). Before the optimizer is
    built: it must step the DTensor parameters."""
    _, world = rank_and_world()
    if world == 1:
        return net
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = _fully_shard()
    mesh = init_device_mesh(device_type, (world,))
    for name, module in list(net.named_modules()):
        if name and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


class RankSlice:
    """The data a process trains on: its slice of every global batch; the held-out sets whole
    (every process evaluates the same examples). Everything else is the data's own."""

    def __init__(self, data: Any, rank: int, world: int) -> None:
        if data.batch_size % world:
            raise UserError(f"data.batch_size={data.batch_size} must be a multiple of "
                            f"distributed.processes={world}: each process takes an equal slice of every batch")
        self.data, self.rank, self.world = data, rank, world
        self._drawn = 0
        self._kill_at = _kill_step(rank)

    def sample(self, generator: torch.Generator) -> Any:
        if self._drawn == self._kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self._drawn += 1
        batch = self.data.sample(generator)
        size = len(batch.x) // self.world
        part = slice(self.rank * size, (self.rank + 1) * size)
        return type(batch)(*(None if field is None else field[part] for field in batch))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)


def _kill_step(rank: int) -> Optional[int]:
    spec = os.environ.get(KILL_ENV, "")
    victim, _, step = spec.partition(":")
    if victim.strip() == str(rank) and step.strip().isdigit():
        return int(step)
    return None


def rank_data(data: Any) -> Any:
    """``data`` itself in one process; this process's ``RankSlice`` of it in several."""
    rank, world = rank_and_world()
    return data if world == 1 else RankSlice(data, rank, world)


def attach_probe(probe: Any) -> None:
    """In several processes, the probe's statistics are of the full tensors: one collective per
    logged step combines every process's part (the recorder's ``probe.ranks.attach``)."""
    if rank_and_world()[1] > 1:
        ranks.attach(probe)
