"""The probe's numerical kernels: fused sums, zero/flush/non-finite counts, means and
spreads, histograms and per-example variances, computed on the tensor's device so that a
logged step moves its results to the host once.

Exactness: zero and fp16-flush counts are integer sums kept below 2^24 in float32 (or summed
in float64), so they are exact; one-pass sums of squares are used only where they are
accurate (``_one_pass_accurate``), two passes elsewhere.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

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


def log2_histogram(g: torch.Tensor) -> torch.Tensor:
    """Counts of |g| per HIST_COLUMNS bin, in one bucketize and one bincount (no host sync)."""
    a = g.detach().abs().float().reshape(-1)
    edges = torch.tensor(HIST_EDGES, dtype=torch.float32, device=a.device)
    # right=True: index i holds edges[i-1] <= log2|g| < edges[i]; 0 is below 2^-40 (and zero).
    idx = torch.bucketize(torch.log2(a), edges, right=True) + 1
    idx = torch.where(a == 0, torch.zeros_like(idx), idx)  # the exact-zero bin
    idx = torch.where(torch.isnan(a), torch.full_like(idx, len(HIST_COLUMNS) - 1), idx)
    return torch.bincount(idx, minlength=len(HIST_COLUMNS)).float()


def dense(t: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the dense tensor it stands for."""
    return t.to_dense() if t.is_sparse else t


def as_real32(t: torch.Tensor) -> torch.Tensor:
    """float32 values to summarise: a complex tensor by its entries' moduli (same norm, same
    zeros), any other by itself (a copy only below float32)."""
    return t.abs().float() if t.is_complex() else t.float()


def _norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    if not tensors:
        return []
    if hasattr(torch, "_foreach_norm"):
        return list(torch._foreach_norm(tensors))
    return [torch.linalg.vector_norm(t) for t in tensors]


# |x| <= FP16_FLUSH  <=>  |x| * _FLUSH_SCALE <= 1, exactly: scaling by a power of 2 is exact.
_FLUSH_SCALE = 2.0**25
# Above this many entries, sums of levels (values 0..4 each) could pass 2^24, where float32
# stops counting exactly: such tensors are summed in float64.
_EXACT_F32 = 2**22


def _levels_(v: torch.Tensor, nan: bool = True) -> torch.Tensor:
    """In place on ``v = |x|``: 0 where x == 0, 1 where 0 < |x| <= FP16_FLUSH, 2 elsewhere
    (NaN and inf included, as ``count_nonzero`` and ``abs() <= FP16_FLUSH`` count them).
    ``clamp_`` then ``nan_to_num_`` rather than one ``fmin``, which is not vectorised on CPU
    (benchmarks/README.md, "Where the probe's time goes").
    ``nan=False`` leaves NaN as NaN (one pass less), for callers that recount a tensor
    whose norm is not finite."""
    v.mul_(_FLUSH_SCALE)
    v.clamp_(max=2.0)  # inf -> 2; NaN stays NaN ...
    if nan:
        torch.nan_to_num_(v, nan=2.0)  # ... and becomes 2 here
    return v.ceil_()


def level_sums(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[sum(l), sum(l^2)]`` of the levels ``l`` of x (see ``_levels_``); ``counts_from_
    level_sums`` turns them into zero and flush counts on the host. Two sums of one
    element-wise result replace ``count_nonzero`` and a boolean mask sum, which on CPU
    are not vectorised and cost several times more. Exact: integer sums below 2^24.
    ``scratch``: a float32 buffer of ``x.numel()`` entries to work in (no allocation)."""
    return torch.stack(_level_sum_pair(x, scratch))


def _level_sum_pair(x: torch.Tensor, scratch: Optional[torch.Tensor], finite: bool = False):
    """The two sums of ``level_sums``, unstacked; ``finite``: the caller knows x holds no
    NaN (the NaN pass is skipped)."""
    v = torch.abs(x.reshape(-1), out=scratch) if scratch is not None else x.reshape(-1).abs()
    v = _levels_(v, nan=not finite)
    if v.numel() <= _EXACT_F32:
        return v.sum(), torch.dot(v, v)
    return v.sum(dtype=torch.float64), v.square_().sum(dtype=torch.float64)


def counts_from_level_sums(numel, s1, s2):
    """Zero entries and entries with |x| <= FP16_FLUSH (zeros included), from
    ``s1 = n1 + 2 n2`` and ``s2 = n1 + 4 n2`` (n1: non-zero flushing, n2: the rest)."""
    n2 = (s2 - s1) / 2
    n1 = s1 - 2 * n2
    return numel - n1 - n2, numel - n2


def _grad_sums(grads: List[torch.Tensor], scratch_for=None) -> torch.Tensor:
    """3 x len(grads), float64: per float32 tensor its plain sum (``collect`` finishes the
    std from it and the norm) and the two ``level_sums`` of its levels, levelled together
    in chunks of about ``_EXACT_F32`` entries. ``scratch_for(n)`` gives a reused float32
    buffer of n entries for the chunk (fresh large tensors page-fault on CPU). NaN stays NaN
    in the level sums: the host
    recounts every tensor whose norm is not finite."""
    device = grads[0].device if grads else None
    out = torch.empty(3, len(grads), dtype=torch.float64, device=device)
    chunk: List[int] = []

    def flush_chunk(size: int) -> None:
        # One flat copy of the chunk: per tensor a plain sum, then levelled in place, with a
        # sum and a dot per tensor (``_foreach_norm(v, 1)`` and ``_foreach_abs``'s fresh
        # allocations cost several times more on CPU).
        parts = [grads[i].reshape(-1) for i in chunk]
        flat = torch.cat(parts) if scratch_for is None else torch.cat(parts, out=scratch_for(size))
        views = flat.split([grads[i].numel() for i in chunk])
        plain = torch.stack([v.sum() for v in views])
        _levels_(flat.abs_(), nan=False)
        rows = [plain, torch.stack([v.sum() for v in views]), torch.stack([torch.dot(v, v) for v in views])]
        out[:, chunk] = torch.stack(rows).double()
        chunk.clear()

    size = 0
    for i, g in enumerate(grads):
        if g.numel() > _EXACT_F32:
            out[0, i] = g.sum()
            out[1:, i] = level_sums(g)
            continue
        if size + g.numel() > _EXACT_F32:
            flush_chunk(size)
            size = 0
        chunk.append(i)
        size += g.numel()
    if chunk:
        flush_chunk(size)
    return out


# One-pass sums of squares are kept only where the mean square is this far inside float32's
# normal range (smallest normal 1.2e-38): squares that underflow then cost < 1e-8 relative.
_ONE_PASS_MIN_MEAN_SQUARE = 1e-30


def _one_pass_accurate(n, mean, square, ssd):
    """Where ``ssd = square - n mean^2`` (``square``: the sum of squares) is accurate: more
    than one entry, mean^2 <= var (the cancellation then costs ~1e-5 relative at most) and
    squares far from underflow; NaN and inf fail every comparison. The one rule for the
    hooks' floats and ``collect``'s arrays alike (``&`` works on both)."""
    return (n > 1) & (ssd < math.inf) & (ssd >= mean * mean * (n - 1)) & (square >= n * _ONE_PASS_MIN_MEAN_SQUARE)


def mean_ssd(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[mean, sum of squared deviations from the mean]`` on the device; the host finishes
    the unbiased std. Two passes (mean, then the deviations' dot) stay accurate for a large
    mean and a small spread (a collapsed layer), where the one-pass ``dot(x, x) - n mean^2``
    cancels; ``torch.var_mean`` gives the same numbers but is an order of magnitude slower on
    CPU. ``scratch`` as in ``level_sums``. On CPU the hooks use ``mean_ssd_host``."""
    flat = x.reshape(-1)
    mean = flat.mean()
    dev = torch.sub(flat, mean, out=scratch) if scratch is not None else flat - mean
    return torch.stack([mean, torch.dot(dev, dev)])  # one read, where square_ + sum take two


def mean_ssd_host(x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> Tuple[float, float]:
    """``mean_ssd`` for a CPU tensor, as two floats: reading a scalar costs nothing there, so
    the one pass ``dot(x, x) - n mean^2`` (one read, no write) is tried first and kept where
    ``mean^2 <= var`` and the mean square is far from underflow: there its error (1e-5
    relative at 2 M entries) is below the two-pass float32 dot's own (3e-4;
    tested). Elsewhere (a collapsed layer, NaN) the two passes. It saves the write of the
    deviations, and the host floats save the small tensors a hook would otherwise build."""
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return math.nan, math.nan
    m = float(flat.sum()) / n
    square = float(torch.dot(flat, flat))
    ssd = square - n * m * m
    if _one_pass_accurate(n, m, square, ssd):
        return m, ssd
    dev = torch.sub(flat, m, out=scratch) if scratch is not None else flat - m
    return m, float(torch.dot(dev, dev))


def _std(ssd: np.ndarray, numel: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(ssd / (numel - 1))


def _stat_rows(values: list, width: int, device) -> torch.Tensor:
    """len(values) x width, float64, on ``device``: the hooks' results, host tuples (CPU) or
    device tensors; None (no hook result for that module) is NaN."""
    if not any(torch.is_tensor(v) for v in values):  # one tensor from host floats
        nan = (math.nan,) * width
        return torch.tensor([nan if v is None else v for v in values], dtype=torch.float64,
                            device=device).reshape(len(values), width)
    nan_t = torch.full((width,), math.nan, dtype=torch.float64, device=device)
    return torch.stack([nan_t if v is None else torch.as_tensor(v, device=device).double()
                        for v in values])


def grad_std_from_sums(norm: np.ndarray, total: np.ndarray, numel: np.ndarray,
                       zeros: np.ndarray) -> np.ndarray:
    """Each gradient's std over its entries from its norm and plain sum, ``(|g|^2 - n mean^2)
    / (n - 1)``, where that is accurate: where ``|mean| <= std`` the cancellation costs at
    most about 2 x 1e-6 relative (float32 norm and sum; tested). NaN elsewhere (a large mean
    over a small spread, a non-finite norm, entries so small that their squares leave
    float32's normal range, one entry), for the probe to recount with the two-pass ``std``;
    an all-zero tensor is 0. Gradients are centred near zero, so the recount is rare; it
    replaces a two-pass ``std`` per tensor."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mean = total / numel
        ssd = norm**2 - numel * mean**2
        accurate = _one_pass_accurate(numel, mean, norm**2, ssd)
        out = np.where(accurate, np.sqrt(np.where(accurate, ssd, 0.0) / (numel - 1)), np.nan)
    return np.where((zeros == numel) & (numel > 1), 0.0, out)


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


def to_host(parts: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
    """Named device tensors as float64 host arrays of the same shapes, in one transfer: a new
    statistic is one more entry, read back by its name."""
    tensors = list(parts.values())
    device = tensors[0].device
    flat = torch.cat([t.to(device=device, dtype=torch.float64).reshape(-1) for t in tensors]).cpu().numpy()
    out, offset = {}, 0
    for name, t in parts.items():
        out[name] = flat[offset : offset + t.numel()].reshape(tuple(t.shape))
        offset += t.numel()
    return out
