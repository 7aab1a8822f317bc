"""The processes of a distributed run, as the recorder sees them.

Every process creates its recorder: the statistics of a sharded tensor need every process's
part, and the one collective of a logged step (``shards.Combiner``) waits for all of them.
The first process writes the run folder. A recorder created on some processes only would
leave the others' collectives unanswered (a hang, or a mismatched collective): a handshake
through the process group's key-value store, with a timeout, turns that into one line at the
first logged step, naming the processes whose recorder never came.
"""

from __future__ import annotations

import datetime
import itertools
from typing import Optional

import numpy as np
import torch

from gradrepro.errors import UserError
from gradrepro.probe.shards import Combiner, counts_here, is_dtensor, local

HANDSHAKE_SECONDS = 120.0  # how long the first logged step waits for the other processes' recorders
_created = itertools.count()  # recorders made in this process: the n-th pairs with the n-th elsewhere


def process_group() -> Optional[tuple]:
    """(rank, world size) of the default process group, or None: not distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def attach(probe, timeout: float = HANDSHAKE_SECONDS) -> Optional[Combiner]:
    """Give ``probe`` the collective of a run of more than one process (None otherwise):
    per tensor, whether this process's part counts toward the full tensor and whether it is
    a plain replica; the device the collective runs on; the handshake."""
    group = process_group()
    if group is None or group[1] == 1:
        return None
    import torch.distributed as dist

    rank, world = group
    combiner = Combiner()
    counted = np.array([counts_here(p, rank) for p in probe.params], dtype=bool)
    plain = np.array([not is_dtensor(p) for p in probe.params], dtype=bool)
    # gloo reduces host tensors; NCCL only device tensors.
    backend = str(dist.get_backend())
    device = torch.device("cpu") if "gloo" in backend else local(probe.params[0]).device
    probe.reducer.distribute(combiner, counted, plain, device)
    combiner.ready = _handshake(rank, world, timeout)
    return combiner


def _handshake(rank: int, world: int, timeout: float):
    """Announce this recorder now; the returned check waits (once) for every other one."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # noqa: BLE001 - no store to meet in: the collective itself must do
        return None
    prefix = f"gradrepro/recorder/{next(_created)}/"
    store.set(prefix + str(rank), "1")
    keys = [prefix + str(r) for r in range(world)]

    def check() -> None:
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - a timeout (its type varies with torch): find who is missing
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise UserError(f"gradrepro.record was not created on rank(s) {missing} of {world} "
                            f"(waited {timeout:g} s at the first logged step): create the recorder on "
                            "every process; rank 0 writes the run folder") from None

    return check
