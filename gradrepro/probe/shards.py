"""Statistics of the full tensor when the tensor lives on several processes.

Under FSDP2 (``fully_shard``) a parameter and its gradient are DTensors: each process holds
a shard (``to_local()``), and the norm of a shard is not the norm of the tensor (the shards'
norms read about 1/sqrt(shards) of it: pytorch/pytorch#170862, pytorch/torchtitan#766).
Under DDP every process holds the whole, synchronised tensor.

The probe summarises what each process holds, then ``Combiner`` finishes the statistics of the
full tensors from every process's per-tensor summaries in ONE collective per logged step: an
all-reduce (sum) of a ``ranks x fields x tensors`` float64 matrix in which each process fills
its own row (an all-gather of a few numbers per tensor, on every backend; no tensor is
gathered). Sums of squares and counts add over the processes that hold a part; means and
spreads combine by the pairwise update (Chan et al. 1979); a replicated tensor (every
process's copy is the whole) counts once, from the first process that holds it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from gradrepro.errors import UserError

try:  # public since torch 2.5; torch 2.4 has it under the private name
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - depends on the torch version
    try:
        from torch.distributed._tensor import DTensor, Replicate
        from torch.distributed._tensor.placement_types import Partial
    except ImportError:
        DTensor = Replicate = Partial = None  # type: ignore[assignment,misc]

# Per tensor, what each process sends: its entries, whether it holds a gradient, the
# gradient's mean and spread (sum of squared deviations), sums of squares (gradient, fresh
# gradient, parameter, update), counts (zero, fp16-flush-or-zero, non-finite, bf16 updates
# below half a unit in the last place) and whether its part counts toward the full tensor.
SUMS = ("g_sumsq", "f_sumsq", "p_sumsq", "u_sumsq", "zeros", "small", "nonfinite", "bf16_lost")
FIELDS = ("n", "have", "g_mean", "g_ssd") + SUMS + ("counted",)


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``t``: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def counts_here(t: torch.Tensor, rank: int) -> bool:
    """Whether this process's part of ``t`` is a part of the full tensor that no other
    process's counted part repeats: a shard always; a replica only at coordinate 0 of each
    replicated mesh dimension; a plain tensor (DDP's replicas) only on global rank 0."""
    if not is_dtensor(t):
        return rank == 0
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # this process is outside the tensor's mesh
        return False
    for dim, placement in enumerate(t.placements):
        if Partial is not None and isinstance(placement, Partial):
            raise UserError("a gradient is a DTensor with a Partial placement (its reduction is still "
                            "pending) when the optimizer steps: gradrepro reads the reduced gradient; "
                            "valid placements are Shard and Replicate")
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return False
    return True


class Combiner:
    """The one collective of a logged step, and what it says about the processes."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.disagree: Dict[int, int] = {}  # rank -> first logged step its replicas differed
        self.nonfinite: Dict[int, int] = {}  # rank -> first logged step it held a non-finite gradient
        self.ready = None  # called once before the first collective (ranks.attach's handshake)

    def combine(self, step: int, stats: Dict[str, np.ndarray], counted: np.ndarray,
                plain: np.ndarray, device: torch.device) -> Dict[str, np.ndarray]:
        """Per-tensor statistics of the full tensors from this process's ``stats`` (arrays of
        FIELDS but ``counted``), ``counted`` (its part counts) and ``plain`` (not a DTensor)."""
        if self.ready is not None:
            self.ready()
            self.ready = None
        n = len(counted)
        mine = np.stack([np.asarray(stats[f], dtype=np.float64) for f in FIELDS[:-1]] + [counted.astype(float)])
        matrix = torch.zeros(self.world, len(FIELDS), n, dtype=torch.float64, device=device)
        matrix[self.rank] = torch.from_numpy(mine).to(device)
        self.dist.all_reduce(matrix, group=self.group)  # the one collective: every row filled
        every = matrix.cpu().numpy()
        self._note_ranks(step, every, plain)
        return combine_rows(every)

    def _note_ranks(self, step: int, every: np.ndarray, plain: np.ndarray) -> None:
        """Replicated tensors are bitwise equal on every process while the processes stay in
        step (an all-reduce gives every process the same result; the same update follows), so
        any difference in their sums of squares means the processes diverged."""
        f = {name: i for i, name in enumerate(FIELDS)}
        for rank in range(self.world):
            if plain.any() and rank not in self.disagree:
                for field in ("p_sumsq", "g_sumsq"):
                    a, b = every[rank, f[field], plain], every[0, f[field], plain]
                    if not np.array_equal(a, b, equal_nan=True):
                        self.disagree[rank] = step
                        break
            if rank not in self.nonfinite and every[rank, f["nonfinite"]].sum() > 0:
                self.nonfinite[rank] = step

    def summary(self) -> Dict[str, object]:
        out: Dict[str, object] = {"ranks": self.world}
        if self.disagree:
            out["ranks_disagree"] = {str(r): s for r, s in sorted(self.disagree.items())}
        if self.nonfinite:
            out["ranks_nonfinite"] = {str(r): s for r, s in sorted(self.nonfinite.items())}
        return out


def combine_rows(every: np.ndarray) -> Dict[str, np.ndarray]:
    """``ranks x FIELDS x tensors`` -> per-tensor statistics of the full tensors: the rows of
    the processes whose part counts, summed, and their means and spreads combined."""
    f = {name: every[:, i] for i, name in enumerate(FIELDS)}
    w = f["counted"]
    n_r = f["n"] * w
    out = {"n": n_r.sum(0), "have": (f["have"] * w).max(0)}
    for name in SUMS:
        out[name] = _wsum(f[name], w)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = _wsum(f["g_mean"] * n_r, n_r > 0) / out["n"]
        spread = _wsum(n_r * (f["g_mean"] - mean) ** 2, n_r > 0)
    out["g_mean"] = mean
    out["g_ssd"] = _wsum(f["g_ssd"], n_r > 0) + spread
    return out


def _wsum(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Sum over ranks of ``values`` where ``keep`` (a NaN where not kept does not count)."""
    return np.where(keep > 0, values, 0.0).sum(0)


def sharded_setup(params: Sequence[torch.Tensor]) -> Optional[List[bool]]:
    """None when no parameter is a DTensor; else, per parameter, whether it is one. A DTensor
    without an initialised process group is one line."""
    flags = [is_dtensor(p) for p in params]
    if not any(flags):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UserError("the model's parameters are DTensors but no process group is initialised: call "
                        "torch.distributed.init_process_group (or init_device_mesh) on every process "
                        "before gradrepro.record")
    return flags
