"""The probe's numerical kernels: the fp16-flush levels, sums of squares that survive
tiny values, histograms, per-example variances and the one transfer to the host. The block
passes that apply them to many tensors at once are in ``probe/blocks.py``.

Sums of squares are kept twice, of ``x`` and of ``x`` scaled by a power of two (exact), and
``squares_from_norms`` picks one on the host. The first where its mean square is at least
2^-100 and its norm below 2^60: entries whose squares leave float32's normal range then cost
< 2^-26 relative, and nothing overflows. Below, every entry is under 2^-36 (for at most 2^26
entries), so the copy scaled by 2^100 neither overflows nor underflows; above, the copy is
scaled by 2^-100. Gradients of 1e-30, float32 subnormals and entries of 1e38 get their true
norm on every device, in float32 arithmetic.
"""

from __future__ import annotations

from typing import Dict, List, Tuple, Union

import numpy as np
import torch

# Activation-gradient histogram (probe.act_grad_hist): octaves [2^k, 2^(k+1)) for k = -40..-1,
# plus an exact-zero bin, a bin below 2^-40 and one at or above 2^0 (inf included). SSD's
# band [2^-27, 2^-24) is bins -27..-25 (Micikevicius et al. 2018, Fig. 3).
HIST_EDGES = list(range(-40, 1))  # bin boundaries in log2 units
HIST_COLUMNS = (
    ["act_grad_hist_zero", "act_grad_hist_below"]
    + [f"act_grad_hist_{k}" for k in HIST_EDGES[:-1]]
    + ["act_grad_hist_above"]
)


_EDGES: Dict[torch.device, torch.Tensor] = {}  # HIST_EDGES per device, made once (a copy to a
# GPU makes the host wait for it)


def log2_histogram(g: torch.Tensor) -> torch.Tensor:
    """Counts of |g| per HIST_COLUMNS bin, in one bucketize and one bincount (no host sync)."""
    a = g.detach().abs().float().reshape(-1)
    edges = _EDGES.get(a.device)
    if edges is None:
        edges = _EDGES[a.device] = torch.tensor(HIST_EDGES, dtype=torch.float32, device=a.device)
    # right=True: index i holds edges[i-1] <= log2|g| < edges[i]; 0 is below 2^-40 (and zero).
    idx = torch.bucketize(torch.log2(a), edges, right=True) + 1
    idx = torch.where(a == 0, torch.zeros_like(idx), idx)  # the exact-zero bin
    idx = torch.where(torch.isnan(a), torch.full_like(idx, len(HIST_COLUMNS) - 1), idx)
    return torch.bincount(idx, minlength=len(HIST_COLUMNS)).float()


# |x| <= FP16_FLUSH  <=>  |x| * _FLUSH_SCALE <= 1, exactly: scaling by a power of 2 is exact.
_FLUSH_SCALE = 2.0**25


def levels_(v: torch.Tensor, nan: bool = True) -> torch.Tensor:
    """In place on ``v = |x|``: 0 where x == 0, 1 where 0 < |x| <= FP16_FLUSH, 2 elsewhere
    (NaN and inf included, as ``count_nonzero`` and ``abs() <= FP16_FLUSH`` count them).
    ``clamp_`` then ``nan_to_num_`` rather than one ``fmin``, which is not vectorised on CPU
    (benchmarks/README.md). ``nan=False`` leaves NaN as NaN (one pass less), for callers that
    recount a tensor whose sums are not finite."""
    v.mul_(_FLUSH_SCALE)
    v.clamp_(max=2.0)  # inf -> 2; NaN stays NaN ...
    if nan:
        torch.nan_to_num_(v, nan=2.0)  # ... and becomes 2 here
    return v.ceil_()


def counts_from_level_sums(numel, s1, s2):
    """Zero entries and entries with |x| <= FP16_FLUSH (zeros included), from
    ``s1 = n1 + 2 n2`` and ``s2 = n1 + 4 n2`` (n1: non-zero flushing, n2: the rest)."""
    n2 = (s2 - s1) / 2
    n1 = s1 - 2 * n2
    return numel - n1 - n2, numel - n2


# Sums of squares of x * 2^100 (or 2^-100) beside those of x (see the module docstring).
SCALE_UP, SCALE_DOWN = 2.0**100, 2.0**-100
HI_MIN_MEAN_SQUARE = 2.0**-100
HI_MAX_NORM = 2.0**60  # at or above it (or inf) the copy is scaled down instead


def lo_scale(hi, up=SCALE_UP, down=SCALE_DOWN):
    """The power of two the second sum of squares scales by, from the first norm ``hi``
    (a device tensor or a host array: the same comparison on the same float32 values).
    ``up`` and ``down`` may be 0-d device tensors holding the two scales (kept by the
    caller, so that no constant is made anew on each step)."""
    if isinstance(hi, np.ndarray):
        return np.where(hi < HI_MAX_NORM, up, down)
    return torch.where(hi < HI_MAX_NORM, up, down)


def squares_from_norms(hi: np.ndarray, lo: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Sums of squares from the norms of ``x`` (``hi``) and of ``x * lo_scale(hi)`` (``lo``),
    ``numel`` entries each (see the module docstring); NaN stays NaN."""
    scale = lo_scale(hi)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(hi_usable(hi, numel), hi * hi, (lo / scale) ** 2)


def hi_usable(hi: np.ndarray, numel) -> np.ndarray:
    """Where ``squares_from_norms`` takes a block's sum of squares from ``hi`` (of ``numel``
    entries) rather than from the scaled norm: False for NaN."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (hi * hi >= numel * HI_MIN_MEAN_SQUARE) & (hi < HI_MAX_NORM)


def list_norms(tensors: List[torch.Tensor]) -> torch.Tensor:
    """3 x len(tensors): the norms of each tensor, of it times 2^100 and of it times 2^-100,
    in five multi-tensor operations; ``robust_norms`` picks on the host."""
    rows = []
    for scale in (1.0, SCALE_UP, SCALE_DOWN):
        scaled = tensors if scale == 1.0 else torch._foreach_mul(tensors, scale)
        rows.append(torch.stack(list(torch._foreach_norm(scaled))).float())
    return torch.stack(rows)


def robust_norms(rows: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """The norms of ``list_norms``' tensors, from its three rows on the host."""
    hi, up, down = rows
    lo = np.where(lo_scale(hi) == SCALE_UP, up, down)
    return np.sqrt(squares_from_norms(hi, lo, np.asarray(numel, dtype=np.float64)))


def std_from_ssd(ssd: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """The unbiased std from a sum of squared deviations (NaN for fewer than two entries)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(numel > 1, np.sqrt(ssd / (numel - 1)), np.nan)


def per_example_stats(delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Variances of one linear layer's per-example gradients, pooled over examples and entries.

    ``delta`` (NxJ): each example's gradient of its own loss at the layer's output s = Wx + b
    (Glorot & Bengio's back-propagated gradient dCost/ds); ``x`` (NxK): the layer's input.
    The per-example weight gradient is the outer product delta_i x_i^T, so its pooled second
    moment is mean_i(|delta_i|^2 |x_i|^2) / (J K) and its mean is sum(delta^T x) / (N J K):
    no N x J x K tensor is formed. Returns [Var(delta), Var(dloss_i/dW)].
    """
    n, j = delta.shape
    k = x.shape[1]
    count = float(n * j * k)
    second = (delta.pow(2).sum(1) * x.pow(2).sum(1)).sum() / count
    mean = (delta.t() @ x).sum() / count
    return torch.stack([delta.var(unbiased=False), second - mean**2])


def to_host(parts: Dict[str, Union[torch.Tensor, Tuple[torch.Tensor, tuple]]]) -> Dict[str, np.ndarray]:
    """Named device tensors as float64 host arrays of the same shapes, in one transfer (one
    concatenation, one copy to the host): a new statistic is one more entry, read back by its
    name. A part is a tensor, or a (flat view made once, shape) pair, which costs no view on
    each step. The copy is explicit even on CPU, so that the transfer is one countable operation."""
    pairs = [t if isinstance(t, tuple) else (t.reshape(-1), tuple(t.shape)) for t in parts.values()]
    dtype = torch.float64 if any(f.dtype == torch.float64 for f, _ in pairs) else torch.float32
    flat = torch.cat([f if f.dtype == dtype else f.to(dtype) for f, _ in pairs])
    host = flat.to("cpu", copy=True).numpy().astype(np.float64)
    out, offset = {}, 0
    for name, (f, shape) in zip(parts, pairs):
        out[name] = host[offset : offset + f.numel()].reshape(shape)
        offset += f.numel()
    return out
